"""A sweeper of one study reduced to its claims (`launcher.search.claims`), for tests/test_search_parallel.py: the
real storage, the real picking of trials and telling of outcomes; each trial's "run" logs its steps to
`<sweep dir>/<n>/steps` ("<pid> <step>" a line) and checkpoints every 3 steps (`<n>/checkpoint`), going on from there
when it is run again.

    python tests/claims_sweeper.py SPEC SWEEP_DIR N_TRIALS
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import optuna

from launcher.search.claims import Claims, check_home, pick
from launcher.search.study import open_study, tell

STEPS, EVERY = 8, 3


def run(folder: Path, x: float) -> float:
    folder.mkdir(exist_ok=True)
    saved = folder / "checkpoint"
    start = int(saved.read_text()) if saved.exists() else 0
    for step in range(start + 1, STEPS + 1):
        time.sleep(0.1)
        with open(folder / "steps", "a") as f:
            f.write(f"{os.getpid()} {step}\n")
        if step % EVERY == 0:
            (folder / "checkpoint.tmp").write_text(str(step))
            (folder / "checkpoint.tmp").replace(saved)
    return (x - 0.3) ** 2


def main(spelled: str, sweep_dir: Path, n_trials: int) -> None:
    distributions = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    claims = Claims(sweep_dir, spelled)
    with claims.study():
        study = open_study("s", spelled, "minimize", optuna.samplers.RandomSampler(seed=0), None, ["x"])
        check_home(study, sweep_dir, spelled)

    def reseed(made: int) -> None:
        study.sampler = optuna.samplers.RandomSampler(seed=made)

    while (picked := pick(study, claims, distributions, n_trials, reseed)) is not None:
        trial, interrupted = picked
        print(f"{os.getpid()} {'resumes' if interrupted else 'runs'} {trial.number}", flush=True)
        value = run(sweep_dir / str(trial.number), trial.params["x"])
        tell(study, trial, {"state": "complete", "objective": value})
        claims.let_go(trial.number)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
