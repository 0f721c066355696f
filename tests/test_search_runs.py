"""Searches that really run: each trial a distributed run of 2 gloo ranks, the study in its SQLite file read back
with optuna's own API.

- a 4-trial study over optim.lr, stopped (SIGTERM) while its second trial trains, then killed (SIGKILL) while its third
  does, each time run again with the same command: it reaches its budget without running a finished trial again, each
  interrupted trial goes on in its own folder (from its checkpoint, if it saved one), and every trial's value is the
  last val_loss its run logged;
- a study whose sampled value is refused records a failed trial and completes the other (a transformers GPT-2);
- a pruner that always prunes stops the trial at its first evaluation, on every rank, with a checkpoint: exit 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from conftest import LAUNCH, TINY, clean_env
from optuna.trial import TrialState

from launcher.search.objective import read_metrics

JOB = [
    *(o for o in TINY if not o.startswith("trainer.eval_every")),
    "gpus=2",
    "batch.global_size=16",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.max_steps=16",
]
SEARCH = ["-m", "hydra/sweeper=launch_optuna", "optim.lr=tag(log,interval(1e-4,1e-2))", *JOB]


def command(sweep: Path, *overrides: str, base: list[str] = SEARCH) -> list[str]:
    return [LAUNCH, *base, *overrides, f"hydra.sweep.dir={sweep}"]


def study(sweep: Path, name: str = "search") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep / 'study.db'}")


def raw_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def until(proc: subprocess.Popen[str], ready: Callable[[], bool]) -> None:
    """Wait, polling, until `ready()` (a file a run writes) or the process ended."""
    while proc.poll() is None and not ready():
        time.sleep(0.01)


@pytest.fixture(scope="module")
def continued(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A 4-trial study stopped by SIGTERM (a SLURM requeue's warning) once its second trial has saved a checkpoint, run
    again and killed (SIGKILL: a preemption) once its third trial has logged a step, then run to its end: the same
    command each time. Its sweep directory and the output of each run."""
    tmp = tmp_path_factory.mktemp("search")
    sweep, env = tmp / "sweep", clean_env(tmp)
    cmd = command(sweep, "hydra.sweeper.n_trials=4", "trainer.checkpoint_every=4")
    outputs = []
    for sig, ready in (
        (signal.SIGTERM, lambda: (sweep / "1" / "checkpoints" / "latest").exists()),
        (
            signal.SIGKILL,
            lambda: bool((sweep / "2" / "metrics.jsonl").exists() and (sweep / "2" / "metrics.jsonl").read_text()),
        ),
    ):
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        until(proc, ready)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=600)
        expected = 128 + sig if sig == signal.SIGTERM else -sig
        assert proc.returncode == expected, out
        outputs.append(out)
    last = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stdout + last.stderr
    return sweep, [*outputs, last.stdout]


def launched(out: str) -> int:
    return sum("Launching 1 jobs locally" in line for line in out.splitlines())


@pytest.mark.long  # ~40 s with its study: a study resumed from its storage; its
# sweeper and storage are tested in process (test_search)
def test_a_stopped_and_killed_study_continues_to_its_budget_without_repeating_a_finished_trial(continued) -> None:
    sweep, (stopped, killed, last) = continued
    trials = study(sweep).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3] and {t.state for t in trials} == {TrialState.COMPLETE}
    assert "launch: trial 0 complete" in stopped and "the study stopped during trial 1" in stopped, stopped
    assert "continuing: 1 of 4 trial(s) done" in killed and "launch: trial 1 was interrupted" in killed, killed
    resumed_from = int(re.search(r"resuming from \S+/1/checkpoints/step_(\d+)", killed).group(1))  # type: ignore[union-attr]
    assert "launch: trial 1 complete" in killed and launched(killed) == 2, killed  # trials 1 and 2; 0 not again
    assert "continuing: 2 of 4 trial(s) done" in last and "launch: trial 2 was interrupted" in last, last
    assert launched(last) == 2, last  # trials 2 and 3; 0 and 1 not again
    for n in (0, 3):  # each ran once: every step logged once
        assert raw_steps(sweep / str(n)) == list(range(1, 17)), n
    stopped_steps = raw_steps(sweep / "1")  # stopped after its checkpoint's step, then on from that checkpoint
    assert stopped_steps[-(16 - resumed_from) :] == list(range(resumed_from + 1, 17)), stopped_steps
    assert resumed_from >= 4 and stopped_steps[:resumed_from] == list(range(1, resumed_from + 1)), stopped_steps
    killed_steps = raw_steps(sweep / "2")  # the killed attempt's first steps (no checkpoint yet), then all again
    assert killed_steps[-16:] == list(range(1, 17)) and len(killed_steps) > 16, killed_steps


@pytest.mark.long  # the study above; a trial's objective is read in process (test_search)
def test_each_trials_value_is_the_last_val_loss_its_run_logged(continued) -> None:
    sweep, (*_, last) = continued
    trials = study(sweep).get_trials()
    for t in trials:
        records = read_metrics(sweep / str(t.number))
        logged = [r["val_loss"] for r in records if "val_loss" in r][-1]
        assert t.value == logged, (t.number, t.value, logged)
        assert t.intermediate_values == {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
        resolved = (sweep / str(t.number) / "resolved.yaml").read_text()
        assert f"lr: {t.params['optim.lr']}" in resolved and "world_size: 2" in resolved
    assert len({t.params["optim.lr"] for t in trials}) == 4
    best = min(trials, key=lambda t: t.value)
    assert f"launch: best trial {best.number}: {best.value:.6g}" in last
    report = (sweep / "summary.md").read_text().splitlines()
    rows = [line for line in report if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [0, 1, 2, 3], report  # in the order they ran
    assert [r.endswith("| best |") for r in rows] == [t.number == best.number for t in trials], report
    assert (sweep / "summary.png").stat().st_size > 0


GPT2 = [
    "model=custom",
    "model._target_=transformers.GPT2LMHeadModel",
    "+model.config._target_=transformers.GPT2Config",
    *(
        f"+model.config.{k}={v}"
        for k, v in {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 32}.items()
    ),
    "data.format=hf",
]
"""A transformers GPT-2, built from its config (nothing downloaded), on the same synthetic tokens."""


@pytest.mark.long  # ~20 s: a refusal is one line (test_bad_input); the study going on is the stopped-study test's
def test_a_refused_trial_is_failed_and_the_study_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Every point once: the global batch of 20 does not divide over micro 4 x 2 ranks, and is refused.
    cmd = command(
        sweep,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
        "optim.lr=0.003",
        "batch.global_size=choice(16,20)",
        "trainer.max_steps=4",
        *GPT2,
        base=[o for o in SEARCH if not o.startswith("model")],
    )
    run = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    by_size = {t.params["batch.global_size"]: t for t in study(sweep).get_trials()}
    assert by_size[20].state == TrialState.FAIL
    assert (
        "batch.global_size=20 is not divisible by batch.micro_size=4 x world size 2" in by_size[20].user_attrs["reason"]
    )
    assert by_size[16].state == TrialState.COMPLETE
    logged = read_metrics(sweep / str(by_size[16].number))
    assert by_size[16].value == [r["val_loss"] for r in logged if "val_loss" in r][-1]
    assert "launch: error: batch.global_size=20 is not divisible" in run.stderr


def test_a_pruned_trial_stops_at_its_first_evaluation_on_every_rank(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    pruner = ["sweep.pruner._target_=optuna.pruners.ThresholdPruner", "+sweep.pruner.upper=0.0"]  # any loss is above
    cmd = command(sweep, "hydra.sweeper.n_trials=1", *pruner, "trainer.eval_every=2", "trainer.max_steps=6")
    run = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    (trial,) = study(sweep).get_trials()
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [2]
    run_dir = sweep / "0"
    assert raw_steps(run_dir) == [1, 2]
    assert f"launch: trial 0 pruned after step 2 (val_loss {trial.intermediate_values[2]:.4f})" in run.stdout
    (saved,) = (run_dir / "checkpoints").glob("step_*")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert saved.name == "step_00000002" and manifest["world_size"] == 2
    assert {p.name for p in saved.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # both ranks saved step 2
    assert "| pruned | at step 2 |" in (sweep / "summary.md").read_text() and "| pruned | at step 2 |" in run.stdout


@pytest.mark.long  # ~80 s: 3 real trials; the front, the outcome of several figures and the refusals are test_search's
def test_a_multi_objective_study_tells_each_trial_its_figures_and_reports_its_pareto_front(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    multi = ["sweep.objective=[val_loss,tokens_per_s]", "sweep.direction=[minimize,maximize]", "sweep.pruner=null"]
    cmd = command(sweep, "hydra.sweeper.n_trials=3", *multi, "gpus=1", "trainer.max_steps=8")
    run = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    found = study(sweep)
    assert found.directions == [optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE]
    trials = found.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    for t in trials:  # each figure at the run's last step that logged it
        logged = read_metrics(sweep / str(t.number))
        assert t.values == [[r[name] for r in logged if name in r][-1] for name in ("val_loss", "tokens_per_s")]
    front = sorted(t.number for t in found.best_trials)
    line = next(line for line in run.stdout.splitlines() if line.startswith("launch: Pareto front: "))
    assert [int(n) for n in re.findall(r"trial (\d+) \(", line)] == front, line
    rows = [row for row in (sweep / "summary.md").read_text().splitlines() if row.endswith("| Pareto front |")]
    assert [int(row.split("|")[1]) for row in rows] == front
