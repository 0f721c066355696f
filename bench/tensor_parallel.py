"""Tensor parallel on CPU: TP=2 x DP=1 against DP=2, on 2 gloo ranks, the same global batch.

python bench/tensor_parallel.py [--steps 12] [--repeats 1]

Rows: fsdp (DP=2: each rank a micro-batch of its own, every layer whole) and fsdp_tp (TP=2 x DP=1: both ranks on
the same micro-batches, each layer split over them), through the real `launch` (a 4 x 256 GPT, random tokens,
sequence 64, global batch 8, micro-batch 2). Step time is the median of the per-step `step_time_s` in
metrics.jsonl, step 1 (lazy initialisation) left out; the traffic is the strategies' own counters. Said honestly:
over gloo on loopback, with two CPU cores, tensor parallel only costs. It halves each rank's compute per token but
makes each rank run twice the tokens (the data-parallel world is 1), and adds all-reduces of activations, 6 per layer
per micro-step, which a node's NVLink makes cheap and loopback does not. It is for layers or activations that do not
fit a device, not for speed here.

Then loss_parallel (strategy.loss_parallel=true) against the logits gathered, both TP=2 x DP=1 over a vocabulary of
32768, where the head's logits are most of a step's activations: each step's measured peak (`peak_memory_bytes`, the
tensors allocated on the CPU, measured every step: the probe slows them, so no step time is given) and its ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAUNCH = str(Path(sys.executable).parent / "launch")
ROWS = {"DP=2 (fsdp)": ["strategy=fsdp"], "TP=2 x DP=1 (fsdp_tp)": ["strategy=fsdp_tp"]}
LOGITS = {
    "TP=2, the logits gathered": ["strategy=fsdp_tp", "data.vocab_size=32768", "trainer.memory_every=1"],
    "TP=2, loss_parallel": [
        "strategy=fsdp_tp",
        "data.vocab_size=32768",
        "trainer.memory_every=1",
        "strategy.loss_parallel=true",
    ],
}
JOB = [
    "model=gpt_tiny",
    "model.n_layer=4",
    "model.n_embd=256",
    "model.n_head=4",
    "data=synthetic",
    "data.seq_len=64",
    "gpus=2",
    "device=cpu",
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "logger=none",
]


def run(overrides: list[str], steps: int, out: Path) -> dict[str, float]:
    run_dir = out / f"run-{len(list(out.iterdir()))}"
    cmd = [LAUNCH, *overrides, *JOB, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=out)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {
        "step": statistics.median(r["step_time_s"] for r in rows[1:]),
        "fsdp": last["comm_sent_bytes"],
        "tp": last.get("tp_comm_sent_bytes", 0.0),
        "state": last["model_state_bytes"],
        "peak": statistics.median(r["peak_memory_bytes"] for r in rows[1:] if "peak_memory_bytes" in r)
        if len(rows) > 1
        else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    found: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeats):  # alternating: drifting load hits both rows alike
            for name, overrides in (ROWS | LOGITS).items():
                found.setdefault(name, []).append(run(overrides, a.steps, Path(tmp)))
    print("| layout | median step time (s) | FSDP sent per rank (MB) | TP sent per rank (MB) | model state (MiB) |")
    print("|---|---|---|---|---|")
    for name, runs in ((n, r) for n, r in found.items() if n in ROWS):
        step = statistics.median(r["step"] for r in runs)
        last = runs[-1]
        print(
            f"| {name} | {step:.4f} | {last['fsdp'] / 1e6:.2f} | {last['tp'] / 1e6:.2f} | {last['state'] / 2**20:.1f} |"
        )
    dp, tp = (statistics.median(r["step"] for r in found[name]) for name in ROWS)
    print(f"\nTP=2 x DP=1 / DP=2 step time: {tp / dp:.2f}\n")
    print("| vocabulary 32768 | median step peak (MiB) | TP sent per rank (MB) |")
    print("|---|---|---|")
    for name in LOGITS:
        peak = statistics.median(r["peak"] for r in found[name])
        print(f"| {name} | {peak / 2**20:.1f} | {found[name][-1]['tp'] / 1e6:.2f} |")
    gathered, split = (statistics.median(r["peak"] for r in found[name]) for name in LOGITS)
    print(f"\nloss_parallel / the logits gathered, step peak: {split / gathered:.2f}")


if __name__ == "__main__":
    main()
