"""Launcher overhead: the same job through `launch` and through a plain torchrun DDP script.

python bench/overhead.py [--steps 40] [--repeats 2]

Both run gpt_tiny (4 x 128), sequence 128, micro-batch 4, global batch 32, 2 CPU ranks, on the
same random-token task; `launch` twice, logging every 5th step and every step. Step time is the
median over windows of 5 steps (every step's, when it logs every step), the first window (warm-up)
left out; start-up is the wall time from starting the command to the end of the first optimizer
step; the whole process is its wall and CPU time (its children's). Runs alternate, so drifting
machine load hits all alike. Launch's start-up is split into its parts (`STARTUP`), each with its seconds.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(Path(sys.executable).parent / "launch")
WINDOW = 5
TINY_JOB = ["model=gpt_tiny", "data=synthetic", "trainer.eval_every=0", "trainer.progress=false", "logger=none"]
"""The job the benches time: the tiny GPT on random tokens, no evaluation, no logger but metrics.jsonl."""


def launch_rows(overrides: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """`launch` with `overrides` on 2 CPU ranks, random tokens, no evaluation and no logger but metrics.jsonl, in
    `run_dir`: the rows of its metrics.jsonl."""
    argv = [LAUNCH, *TINY_JOB, "gpus=2", "device=cpu", *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(argv, check=True, capture_output=True, cwd=run_dir.parent)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_launch(steps: int, out: Path, log_every: int = WINDOW) -> tuple[float, list[float], dict[str, float]]:
    """Start to the end of the first optimizer step, the windows' step times, and the start-up's parts (`startup`)."""
    run_dir = out / f"launch-{time.monotonic_ns()}"
    started = time.time()
    rows = launch_rows(
        [
            "strategy=ddp",
            "data.seq_len=128",
            "batch.global_size=32",
            "batch.micro_size=4",
            f"trainer.max_steps={steps}",
            f"trainer.log_every={log_every}",
        ],
        run_dir,
    )
    # The runner always logs step 1; the next row covers steps 2-5, then windows of 5 (or one row per step).
    windows = [r["step_time_s"] for r in rows[2 if log_every == WINDOW else WINDOW + 1 :]]
    return rows[0]["time"] - started, windows, startup(run_dir, started, rows[0])


STARTUP = {
    "start to the checked config (imports, composition, the model on the meta device, the checks)": "claimed",
    "to every rank in the process group (the elastic agent, its rendezvous, the workers)": "joined",
    "to the first step's start (the data, the model built and wrapped, the resume, the loggers)": "setup",
    "the first optimizer step": "first_step",
}
"""The parts of a launch's start-up, each told by a file the run writes at its end: the run directory's claim
(`claim.json`, once every check passed), rank 0's record of the process group (`logs/ranks/rank0.json`), and the
first logged step (its time, less its step time)."""


def startup(run_dir: Path, started: float, first: dict[str, float]) -> dict[str, float]:
    claimed = (run_dir / "claim.json").stat().st_mtime
    joined = (run_dir / "logs" / "ranks" / "rank0.json").stat().st_mtime
    step_start = first["time"] - first["step_time_s"]
    return {
        "claimed": claimed - started,
        "joined": joined - claimed,
        "setup": step_start - joined,
        "first_step": first["step_time_s"],
    }


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


RUNNERS = {
    "torchrun": lambda steps, out: (*run_plain(steps, out), {}),
    "launch": lambda steps, out: run_launch(steps, out),
    "launch, every step logged": lambda steps, out: run_launch(steps, out, log_every=1),
}


def compare(steps: int, repeats: int, out: Path) -> dict[str, dict[str, float]]:
    """Each runner's medians (step, start, wall, CPU, and launch's start-up parts) over `repeats` alternating runs."""
    figures: dict[str, dict[str, list[float]]] = {k: {"start": [], "step": [], "wall": [], "cpu": []} for k in RUNNERS}
    for _ in range(repeats):
        for name, fn in RUNNERS.items():
            (first, windows, parts), wall, cpu = _whole(fn, steps, out)
            figures[name]["start"].append(first)
            figures[name]["step"].extend(windows)
            figures[name]["wall"].append(wall)
            figures[name]["cpu"].append(cpu)
            for part, seconds in parts.items():
                figures[name].setdefault(part, []).append(seconds)
    return {k: {m: statistics.median(v) for m, v in f.items()} for k, f in figures.items()}


def report(med: dict[str, dict[str, float]]) -> str:
    """The table, each launch runner's ratios against plain torchrun, and where launch's start-up goes."""
    lines = [
        "| runner | median step time (s) | start to first optimizer step (s) | whole process: wall (s) | CPU (s) |",
        "|---|---|---|---|---|",
        *(f"| {n} | {m['step']:.4f} | {m['start']:.2f} | {m['wall']:.2f} | {m['cpu']:.2f} |" for n, m in med.items()),
    ]
    base = med["torchrun"]
    for name in ("launch", "launch, every step logged"):
        m = med[name]
        lines.append(
            f"\n{name} / torchrun: step time {m['step'] / base['step']:.3f} (goal <= 1.02), start-up "
            f"{m['start'] / base['start']:.3f}, whole process {m['wall'] / base['wall']:.3f} wall and "
            f"{m['cpu'] / base['cpu']:.3f} CPU (goal <= 1.05)"
        )
    m = med["launch"]
    lines.append(
        f"\nlaunch's start-up ({m['start']:.2f} s to the end of the first step; torchrun's: {base['start']:.2f} s):"
    )
    lines += [f"  {m[key]:6.2f} s  {what}" for what, key in STARTUP.items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(report(compare(a.steps, a.repeats, Path(tmp))))


if __name__ == "__main__":
    main()
