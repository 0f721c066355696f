"""bench/scale.py --check: the exactness at scale. One process trains `--steps` steps at global batch 32; `--nodes`
one-rank nodes train the first half and save; `--resume-nodes` nodes resume that run directory and train the rest."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from scale_job import GLOBAL, JOB, LAUNCH, SHAPE, Job, free_port


def check(nodes: int, resume_nodes: int, steps: int, out: Path) -> int:
    """`nodes` one-rank nodes train the first half of `steps` and save, `resume_nodes` resume and train the rest: every
    logged loss is one process's at the same global batch, within 1e-6. Exit status 0 when it is."""
    half = steps // 2
    one = subprocess.run(
        [
            LAUNCH,
            *JOB,
            *SHAPE,
            "gpus=1",
            "batch.micro_size=8",
            f"trainer.max_steps={steps}",
            f"hydra.run.dir={out / 'one'}",
        ],
        cwd=out,
        capture_output=True,
        text=True,
    )
    if one.returncode:
        print(f"one process failed:\n{one.stderr[-3000:]}")
        return 1
    reference = {r["step"]: r["loss"] for r in map(json.loads, (out / "one" / "metrics.jsonl").open())}
    run_dir, worst, started = out / "nodes", {}, time.time()
    for count, last in ((nodes, half), (resume_nodes, steps)):
        port = free_port()
        overrides = [*SHAPE, f"batch.micro_size={GLOBAL // count}", f"trainer.max_steps={last}"]
        with Job(count, run_dir, overrides, port, f"check{count}") as job:
            codes = job.wait(timeout=1800)
            if any(codes):
                print(f"{count} nodes: exit codes {codes}\n{job.output()[-4000:]}")
                return 1
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        mine = [r for r in rows if int(r["world_size"]) == count]
        worst[count] = max(abs(r["loss"] - reference[r["step"]]) for r in mine)
        print(
            f"{count} nodes: steps {mine[0]['step']}-{mine[-1]['step']}, largest difference from one process "
            f"{worst[count]:.2e} ({time.time() - started:.0f} s since the first node's start)"
        )
    steps_logged = sorted(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    if steps_logged != list(range(1, steps + 1)):
        print(f"logged steps {steps_logged}, not 1-{steps}: the resume did not continue where the save left off")
        return 1
    exact = all(w <= 1e-6 for w in worst.values())
    print(
        f"{'exact' if exact else 'NOT EXACT'}: {nodes} nodes then {resume_nodes} nodes against one process, "
        f"global batch {GLOBAL}: largest difference {max(worst.values()):.2e} (<= 1e-6)"
    )
    return 0 if exact else 1
