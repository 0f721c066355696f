"""Launcher overhead: the same job through `launch` and through a plain torchrun DDP script.

python bench/overhead.py [--steps 40] [--repeats 2]

Both run gpt_tiny (4 x 128), sequence 128, micro-batch 4, global batch 32, 2 CPU ranks, on the
same random-token task; `launch` twice, logging every 5th step and every step. Step time is the
median over windows of 5 steps (every step's, when it logs every step), the first window (warm-up)
left out; start-up is the wall time from starting the command to the end of the first optimizer
step; the whole process is its wall and CPU time (its children's). Runs alternate, so drifting
machine load hits all alike.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(Path(sys.executable).parent / "launch")
WINDOW = 5


def run_launch(steps: int, out: Path, log_every: int = WINDOW) -> tuple[float, list[float]]:
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
            f"trainer.log_every={log_every}",
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
    # The runner always logs step 1; the next row covers steps 2-5, then windows of 5 (or one row per step).
    return rows[0]["time"] - started, [r["step_time_s"] for r in rows[2 if log_every == WINDOW else WINDOW + 1 :]]


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


def _whole(fn, *args):  # type: ignore[no-untyped-def]
    """fn's result, its wall seconds and its children's CPU seconds."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = fn(*args)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, wall, (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    runners = {
        "torchrun": lambda steps, out: run_plain(steps, out),
        "launch": lambda steps, out: run_launch(steps, out),
        "launch, every step logged": lambda steps, out: run_launch(steps, out, log_every=1),
    }
    figures: dict[str, dict[str, list[float]]] = {k: {"start": [], "step": [], "wall": [], "cpu": []} for k in runners}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeats):
            for name, fn in runners.items():
                (first, windows), wall, cpu = _whole(fn, a.steps, Path(tmp))
                figures[name]["start"].append(first)
                figures[name]["step"].extend(windows)
                figures[name]["wall"].append(wall)
                figures[name]["cpu"].append(cpu)
    med = {k: {m: statistics.median(v) for m, v in f.items()} for k, f in figures.items()}
    print("| runner | median step time (s) | start to first optimizer step (s) | whole process: wall (s) | CPU (s) |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['step']:.4f} | {m['start']:.2f} | {m['wall']:.2f} | {m['cpu']:.2f} |")
    base = med["torchrun"]
    for name in ("launch", "launch, every step logged"):
        m = med[name]
        print(f"\n{name} / torchrun: step time {m['step'] / base['step']:.3f} (goal <= 1.02), start-up "
              f"{m['start'] / base['start']:.3f}, whole process {m['wall'] / base['wall']:.3f} wall and "
              f"{m['cpu'] / base['cpu']:.3f} CPU (goal <= 1.05)")  # fmt: skip


if __name__ == "__main__":
    main()
