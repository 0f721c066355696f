"""Step time over a long run: does a step cost more at the end than at the start?

python bench/soak.py [--steps 2000] [--checkpoint-every 50] [override ...]

One `launch` run with a checkpoint every `--checkpoint-every` steps (keep_last=2) and one without periodic checkpoints,
both logging every step: gpt_tiny (2 x 64), sequence 32, micro-batch 4, global batch 16, 2 CPU ranks, random tokens.
Prints each run's median step time over its first 100 steps after warm-up (steps 11-110), its middle 100 and its last
100, and last / first (goal: within 1.05). Steps right after a save are left out of every window: they carry the save's
stall (`checkpoint_stall_s`), which the checkpoint bench measures, not a cost that grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = str(Path(sys.executable).parent / "launch")
JOB = [
    "strategy=ddp",
    "model=gpt_tiny",
    "model.n_layer=2",
    "model.n_embd=64",
    "data=synthetic",
    "data.seq_len=32",
    "gpus=2",
    "device=cpu",
    "batch.global_size=16",
    "batch.micro_size=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "logger=none",
    "trainer.keep_last=2",
]
WARM_UP = 10


def run(steps: int, checkpoint_every: int, out: Path, overrides: list[str]) -> list[dict[str, float]]:
    run_dir = out / f"soak-{time.monotonic_ns()}"
    subprocess.run(
        [
            LAUNCH,
            *JOB,
            f"trainer.max_steps={steps}",
            f"trainer.checkpoint_every={checkpoint_every}",
            *overrides,
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        capture_output=True,
        cwd=out,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def windows(rows: list[dict[str, float]], size: int = 100) -> dict[str, float]:
    """Median step time of the first, middle and last `size` steps after warm-up, steps after a save left out."""
    times = [r["step_time_s"] for r in rows[WARM_UP:] if "checkpoint_stall_s" not in r]
    middle = len(times) // 2
    parts = {"first": times[:size], "middle": times[middle - size // 2 : middle + size // 2], "last": times[-size:]}
    return {name: statistics.median(part) for name, part in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("overrides", nargs="*", help="more overrides for both runs, e.g. trainer.memory_every=1")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            f"a checkpoint every {a.checkpoint_every} steps, keep_last=2": run(
                a.steps, a.checkpoint_every, Path(tmp), a.overrides
            ),
            "no periodic checkpoints": run(a.steps, 0, Path(tmp), a.overrides),
        }
    given = " ".join([f"{a.steps} steps", *a.overrides])
    print(f"| {given}: median step time (s) | first 100 | middle 100 | last 100 | last / first |")
    print("|---|---|---|---|---|")
    for name, rows in runs.items():
        w = windows(rows)
        print(f"| {name} | {w['first']:.4f} | {w['middle']:.4f} | {w['last']:.4f} | {w['last'] / w['first']:.3f} |")
    print("\ngoal: last / first within 1.05 (no slowdown over time)")


if __name__ == "__main__":
    main()
