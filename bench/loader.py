"""Does the data loader keep the training fed? Step time with a dataset whose samples cost 5 ms each to read.

python bench/loader.py [--steps 12] [--cost-ms 5] [--workers 4]

Three runs through the real `launch` console script, the same job (the built-in GPT, 4 x 128, sequence 128, on
random tokens; micro-batch 8 x accumulation 2 x 2 CPU ranks = global 32, logger=none): a dataset that costs
nothing, the slow dataset read in the loop (data.workers=0), and the slow dataset read by `--workers` DataLoader
processes per rank ahead of the loop. Figures are the median logged step time after the first step; the ratio is
against the free dataset, measured in the same invocation. Goal: the loader within 1.10 x of free.
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

from torch.utils.data import Dataset

LAUNCH = str(Path(sys.executable).parent / "launch")


class Slow(Dataset):
    """The built-in random tokens, each read `cost_ms` late (an expensive decode, a remote read)."""

    def __init__(self, split: str, cost_ms: float = 5.0, seq_len: int = 128) -> None:
        from launcher.data import Synthetic

        self.inner = Synthetic(split, seq_len=seq_len, vocab_size=256, num_samples=16384, format="tuple")
        self.cost = cost_ms / 1000

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if self.cost:
            time.sleep(self.cost)
        return self.inner[i]


def run(name: str, cost_ms: float, workers: int, steps: int, out: Path) -> float:
    env_path = str(Path(__file__).parent)
    overrides = ["model=gpt_tiny", "model.block_size=128", "data=custom", "data._target_=loader.Slow",
                 f"+data.cost_ms={cost_ms}", f"+data.workers={workers}", "batch.micro_size=8", "batch.global_size=32",
                 "gpus=2", "device=cpu",
                 f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.eval_every=0", "logger=none",
                 "trainer.progress=false", "trainer.save_at_end=false", f"hydra.run.dir={out / name}"]  # fmt: skip
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([LAUNCH, *overrides], capture_output=True, text=True, env=env, cwd=out)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--cost-ms", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        free = run("free", 0.0, 0, a.steps, Path(tmp))
        inline = run("slow-inline", a.cost_ms, 0, a.steps, Path(tmp))
        loaded = run("slow-loader", a.cost_ms, a.workers, a.steps, Path(tmp))
    print(f"median step time, 2 CPU ranks, 16 samples per rank per step, {a.cost_ms:g} ms per sample\n")
    print("| dataset | data.workers | step time (s) | x free |")
    print("|---|---|---|---|")
    for name, workers, t in (("free", 0, free), ("slow", 0, inline), ("slow", a.workers, loaded)):
        print(f"| {name} | {workers} | {t:.4f} | {t / free:.2f} |")
    print(f"\nloader / free = {loaded / free:.3f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
