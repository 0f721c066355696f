"""Does the data loader keep the training fed? Two comparisons, each through the real `launch` console script on the
same job (the built-in GPT, 4 x 128, sequence 128, random tokens; micro-batch 8 x accumulation 2 x 2 CPU ranks =
global 32, logger=none). Figures are the median logged step time after the first step, and samples/s; each ratio is
against the first row, measured in the same invocation.

python bench/loader.py [--only slow|kinds|mix] [--steps 12] [--cost-ms 5] [--workers 4]

- slow: a dataset that costs nothing; one whose samples cost 5 ms each, read in the loop (data.workers=0); the same
  read by `--workers` DataLoader processes per rank ahead of the loop. Goal: the loader within 1.10 x of free.
- kinds: the same samples as a map-style dataset; as a stream (an IterableDataset: every rank reads the whole
  stream and keeps its share, `launcher.data.sources`), read in the loop and by one reader process ahead of it; as rows
  of Python lists through the default collate; and through a collate of the user's (padding to the longest).
  Goal: a stream within 1.05 x of the map-style dataset.
- mix: one map-style source alone (data=custom), against data=mix of three sources (weights 0.5/0.3/0.2): three of
  that kind (the cost of mixing alone), and three kinds (that one, a stream, rows of lists) read in the loop and by one
  reader process. Goal: the mixture within 1.05 x. Then a step's allocation alone (which source fills each slot), for
  8 sources at global batches of 16, 512 and 65,536: its cost should not grow with B.
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

from torch.utils.data import Dataset, IterableDataset

LAUNCH = str(Path(sys.executable).parent / "launch")


class Slow(Dataset):
    """The built-in random tokens, each read `cost_ms` late (an expensive decode, a remote read)."""

    def __init__(self, split: str, cost_ms: float = 5.0, seq_len: int = 128) -> None:
        from launcher.data.builtin import Synthetic

        self.inner = Synthetic(split, seq_len=seq_len, vocab_size=256, num_samples=16384, format="tuple")
        self.cost = cost_ms / 1000

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if self.cost:
            time.sleep(self.cost)
        return self.inner[i]


class Stream(IterableDataset):
    """The same random tokens as a stream, in their order."""

    def __init__(self, split: str, seq_len: int = 128) -> None:
        from launcher.data.builtin import Synthetic

        self.inner = Synthetic(split, seq_len=seq_len, vocab_size=256, num_samples=16384, format="tuple")

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.inner[i] for i in range(len(self.inner)))


class Rows(Dataset):
    """The same random tokens as rows of Python lists, as a `datasets.Dataset` gives them."""

    def __init__(self, split: str, seq_len: int = 128) -> None:
        from launcher.data.builtin import Synthetic

        self.inner = Synthetic(split, seq_len=seq_len, vocab_size=256, num_samples=16384, format="tuple")

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        x, y = self.inner[i]
        return x.tolist(), y.tolist()


def pad(samples):  # type: ignore[no-untyped-def]
    """A user's collate: tuples of lists padded to the longest (inputs with 0, targets with -100)."""
    import torch

    longest = max(len(x) for x, _ in samples)
    x = torch.zeros(len(samples), longest, dtype=torch.long)
    y = torch.full((len(samples), longest), -100, dtype=torch.long)
    for i, (xs, ys) in enumerate(samples):
        x[i, : len(xs)], y[i, : len(ys)] = torch.tensor(xs), torch.tensor(ys)
    return x, y


def run(name: str, data: list[str], steps: int, out: Path) -> tuple[float, float]:
    """The median step time after the first step, and the median samples/s, of one launch with `data` overrides."""
    env_path = str(Path(__file__).parent)
    chosen = data if any(d.startswith("data=") for d in data) else ["data=custom", *data]
    overrides = [
        "model=gpt_tiny",
        "model.block_size=128",
        *chosen,
        "batch.micro_size=8",
        "batch.global_size=32",
        "gpus=2",
        "device=cpu",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "logger=none",
        "trainer.progress=false",
        "trainer.save_at_end=false",
        f"hydra.run.dir={out / name}",
    ]
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([LAUNCH, *overrides], capture_output=True, text=True, env=env, cwd=out)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:]), statistics.median(
        r["samples_per_s"] for r in rows[1:]
    )


def table(title: str, rows: list[tuple[str, tuple[float, float]]]) -> None:
    base = rows[0][1][0]
    print(f"\n{title}\n")
    print("| dataset | step time (s) | samples/s | x first |")
    print("|---|---|---|---|")
    for name, (t, rate) in rows:
        print(f"| {name} | {t:.4f} | {rate:.0f} | {t / base:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("slow", "kinds", "mix"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--cost-ms", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if a.only == "mix":
            return mix(a, out)
        if a.only != "kinds":
            slow = ["data._target_=loader.Slow", f"+data.cost_ms={a.cost_ms}"]
            rows = [
                ("free", run("free", ["data._target_=loader.Slow", "+data.cost_ms=0"], a.steps, out)),
                ("slow, data.workers=0", run("slow-inline", slow, a.steps, out)),
                (
                    f"slow, data.workers={a.workers}",
                    run("slow-loader", [*slow, f"+data.workers={a.workers}"], a.steps, out),
                ),
            ]
            table(
                f"2 CPU ranks, 16 samples per rank per step, {a.cost_ms:g} ms per sample (goal: the loader <= 1.10 x "
                "free)",
                rows,
            )
        if a.only != "slow":
            kinds = [
                ("map-style", ["data._target_=loader.Slow", "+data.cost_ms=0"]),
                ("stream, read in the loop", ["data._target_=loader.Stream"]),
                ("stream, a reader process (data.workers=1)", ["data._target_=loader.Stream", "+data.workers=1"]),
                ("rows of lists, the default collate", ["data._target_=loader.Rows"]),
                (
                    "rows of lists, a collate of one's own",
                    ["data._target_=loader.Rows", "data.collate._target_=loader.pad"],
                ),
            ]
            # Each kind `--repeats` times, the kinds interleaved (a machine's load drifts), its fastest median kept.
            found: dict[str, list[tuple[float, float]]] = {}
            for r in range(a.repeats):
                for i, (name, data) in enumerate(kinds):
                    found.setdefault(name, []).append(run(f"kind{i}-{r}", data, a.steps, out))
            rows = [(name, min(found[name])) for name, _ in kinds]
            table("2 CPU ranks, the same samples from each kind of source (goal: a stream <= 1.05 x map-style)", rows)
        if a.only is None:
            mix(a, out)


MIX = (
    "data.sources={one:{weight:0.5,_target_:loader.Slow,cost_ms:0},two:{weight:0.3,_target_:loader.Stream},"
    "three:{weight:0.2,_target_:loader.Rows}}"
)
SAME = (
    "data.sources={one:{weight:0.5,_target_:loader.Slow,cost_ms:0},two:{weight:0.3,_target_:loader.Slow,"
    "cost_ms:0},three:{weight:0.2,_target_:loader.Slow,cost_ms:0}}"
)
"""Three map-style sources of the kind the single source is: the cost of mixing alone."""


def mix(a: argparse.Namespace, out: Path) -> None:
    """One map-style source against a mixture of three kinds, interleaved `--repeats` times, each one's fastest."""
    kinds = [
        ("one map-style source", ["data._target_=loader.Slow", "+data.cost_ms=0"]),
        ("data=mix, three map-style sources, read in the loop", ["data=mix", SAME]),
        ("data=mix, map-style + stream + rows, read in the loop", ["data=mix", MIX]),
        ("data=mix, map-style + stream + rows, a reader", ["data=mix", MIX, "data.workers=1"]),
    ]
    found: dict[str, list[tuple[float, float]]] = {}
    for r in range(a.repeats):
        for i, (name, data) in enumerate(kinds):
            found.setdefault(name, []).append(run(f"mix{i}-{r}", data, a.steps, out))
    table(
        "2 CPU ranks, one source against a mixture of three (goal: the mixture <= 1.05 x one source)",
        [(name, min(found[name])) for name, _ in kinds],
    )
    allocation()


def allocation(sources: int = 8, steps: int = 2000) -> None:
    """A step's allocation alone (`launcher.mixture.weights.plan`), for `sources` sources under a schedule that moves
    a weight to 0 and back, at several global batches: the fastest of 3 passes over `steps` steps."""
    import numpy as np

    from launcher.mixture.weights import Weights, plan

    names = [f"s{i}" for i in range(sources)]
    schedule = [{"step": steps // 4, "weights": {"s0": 0.0}}, {"step": steps // 2, "weights": {"s0": 5.0}}]
    weights = Weights({n: 1.0 + i for i, n in enumerate(names)}, schedule)
    print(f"\nA step's allocation alone, {sources} sources, the fastest of 3 passes of {steps} steps\n")
    print("| global batch | ms a step |\n|---|---|")
    for size in (16, 512, 65536):
        best = float("inf")
        for _ in range(3):
            debt, ended, bound = np.zeros(sources), np.zeros(sources, dtype=bool), None
            began = time.perf_counter()
            for step in range(1, steps + 1):
                planned = plan(weights, step, size, debt, ended, bound, "drop", lambda i, count: count)
                debt, ended, bound = planned.debt, planned.ended, planned.bound  # type: ignore[union-attr]
            best = min(best, (time.perf_counter() - began) / steps)
        print(f"| {size:,} | {best * 1e3:.3f} |")


if __name__ == "__main__":
    main()
