"""How long does a checkpoint block training? Synchronous saves against trainer.async_checkpoint=true.

python bench/checkpoint.py [--steps 13] [--every 3] [--seq-len 64]

Two runs through the real `launch` console script, the same job (model=gpt_124m on random tokens of `--seq-len`,
micro-batch 1, 2 CPU ranks under DDP, AdamW: about 1.5 GB of model and optimizer state per checkpoint,
logger=none), saving every `--every` steps and not at the end. The stall is `checkpoint_stall_s`, which the
runner logs on the step after a save: the seconds the loop was blocked by checkpointing (waiting for the save
before, the state's copy to host memory, the write itself when synchronous, the finalisation), the slowest
rank's. Bytes per second: the checkpoint's files (its manifest) over the seconds from the save's step to the
checkpoint being visible (its manifest's time), so under async_checkpoint also the steps that ran meanwhile.
Checksums: xxh3-128's rate in memory (what hashing as the bytes are written adds) and the seconds to verify one
checkpoint before a resume.
The first save is shown apart: under async_checkpoint it also allocates the host buffers the later saves reuse.
Goal: async stall <= 0.2 x sync.
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


def run(name: str, asynchronous: bool, a: argparse.Namespace, out: Path) -> dict[str, float]:
    overrides = [
        "model=gpt_124m",
        "data=synthetic",
        "data.vocab_size=50304",
        f"data.seq_len={a.seq_len}",
        "batch.micro_size=1",
        "batch.global_size=2",
        "gpus=2",
        "device=cpu",
        "strategy=ddp",
        f"trainer.max_steps={a.steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "logger=none",
        "trainer.progress=false",
        "trainer.save_at_end=false",
        f"trainer.checkpoint_every={a.every}",
        "trainer.keep_last=0",
        f"trainer.async_checkpoint={str(asynchronous).lower()}",
        f"hydra.run.dir={out / name}",
    ]
    proc = subprocess.run([LAUNCH, *overrides], capture_output=True, text=True, cwd=out)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = {r["step"]: r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())}
    stalls, rates, sizes = [], [], []
    for folder in sorted((out / name / "checkpoints").glob("step_*")):
        manifest = json.loads((folder / "manifest.json").read_text())
        step, size = manifest["step"], sum(manifest["files"].values())
        stalls.append(rows[step + 1]["checkpoint_stall_s"])  # the step after the save
        rates.append(size / (manifest["time"] - rows[step]["time"]))
        sizes.append(size)
    total = sum(r.get("checkpoint_stall_s", 0.0) for r in rows.values())
    step_time = statistics.median(r["step_time_s"] for s, r in rows.items() if s > 1)
    return {
        "first": stalls[0],  # async: also allocates the host buffers every later save reuses
        "stall": statistics.mean(stalls[1:]),
        "finalise": (total - sum(stalls)) / len(stalls),  # logged on later steps: rank 0's finalisation
        "rate": statistics.mean(rates),
        "bytes": statistics.mean(sizes),
        "step": step_time,
        "saves": len(stalls),
    }


def checksum_cost(folder: Path) -> dict[str, float]:
    """xxh3-128's rate on bytes in memory (what saving adds), and the seconds to verify `folder` (what a resume
    adds: `launcher.checkpoint.format.damage` reads and hashes every file)."""
    import time

    import xxhash

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from launcher.checkpoint.format import damage

    buffer = bytes(256 << 20)
    seconds = []
    for _ in range(4):  # the first pass also maps the buffer's pages: the best of the others
        started = time.perf_counter()
        xxhash.xxh3_128(buffer).hexdigest()
        seconds.append(time.perf_counter() - started)
    memory = len(buffer) / min(seconds[1:])
    started = time.perf_counter()
    assert damage(folder) is None, folder
    return {"memory": memory, "verify": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run("sync", False, a, Path(tmp))
        asyn = run("async", True, a, Path(tmp))
        hashing = checksum_cost(next((Path(tmp) / "sync" / "checkpoints").glob("step_*")))
    print(f"gpt_124m, DDP on 2 CPU ranks, {sync['bytes'] / 1e9:.2f} GB per checkpoint, {sync['saves']} saves per run\n")
    print(
        "| trainer.async_checkpoint | first save's stall (s) | stall per later save (s) | finalisation later (s) "
        "| MB/s written | step time (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in (("false", sync), ("true", asyn)):
        print(
            f"| {name} | {r['first']:.3f} | {r['stall']:.3f} | {r['finalise']:.3f} | {r['rate'] / 1e6:,.0f} "
            f"| {r['step']:.3f} |"
        )
    print(
        f"\nchecksums: xxh3-128 hashes {hashing['memory'] / 1e9:.2f} GB/s in memory, so hashing a checkpoint as it is "
        f"written adds {sync['bytes'] / hashing['memory']:.3f} s to a synchronous save (in the background writer "
        f"under async); verifying one before a resume (reading and hashing its files) takes {hashing['verify']:.3f} s"
    )
    print(
        f"\nasync stall / sync stall, later saves = {asyn['stall'] / sync['stall']:.3f} (goal <= 0.2); "
        f"first saves = {asyn['first'] / sync['first']:.3f}"
    )


if __name__ == "__main__":
    main()
