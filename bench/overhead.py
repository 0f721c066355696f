"""Launcher overhead: the same job through `launch` and through a plain torchrun DDP script.

python bench/overhead.py [--steps 40] [--repeats 2]

Both run gpt_tiny (4 x 128), sequence 128, micro-batch 4, global batch 32, 2 CPU ranks, on the
same random-token task. Step time is the median over windows of 5 steps, the first window
(warm-up) left out; start-up is the wall time from starting the command to the end of the
first optimizer step. Runs alternate, so drifting machine load hits both alike.
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

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(Path(sys.executable).parent / "launch")
WINDOW = 5


def run_launch(steps: int, out: Path) -> tuple[float, list[float]]:
    run_dir = out / f"launch-{time.monotonic_ns()}"
    started = time.time()
    subprocess.run(
        [
            LAUNCH,
            "strategy=ddp",
            "model=gpt_tiny",
            "data=synthetic",
            "data.seq_len=128",
            "gpus=2",
            "device=cpu",
            "batch.global_size=32",
            "batch.micro_size=4",
            f"trainer.max_steps={steps}",
            f"trainer.log_every={WINDOW}",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        capture_output=True,
        cwd=out,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The runner always logs step 1; the next row covers steps 2-5, then windows of 5.
    return rows[0]["time"] - started, [r["step_time_s"] for r in rows[2:]]


def run_plain(steps: int, out: Path) -> tuple[float, list[float]]:
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "bench" / "plain_ddp.py"),
            "--steps",
            str(steps),
            "--window",
            str(WINDOW),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=out,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["first_step_at"] - started, result["window_step_times"][1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    figures: dict[str, dict[str, list[float]]] = {k: {"start": [], "step": []} for k in ("launch", "torchrun")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeats):
            for name, fn in (("launch", run_launch), ("torchrun", run_plain)):
                first, windows = fn(a.steps, Path(tmp))
                figures[name]["start"].append(first)
                figures[name]["step"].extend(windows)
    med = {k: {m: statistics.median(v) for m, v in f.items()} for k, f in figures.items()}
    print("| runner | median step time (s) | start to first optimizer step (s) |")
    print("|---|---|---|")
    for name in ("torchrun", "launch"):
        print(f"| {name} | {med[name]['step']:.4f} | {med[name]['start']:.2f} |")
    print(f"\nstep-time ratio launch / torchrun: {med['launch']['step'] / med['torchrun']['step']:.3f} (goal <= 1.03)")
    print(f"start-up ratio launch / torchrun: {med['launch']['start'] / med['torchrun']['start']:.3f}")


if __name__ == "__main__":
    main()
