"""Every DeepSpeed preset against DDP: step time and per-rank model-state bytes, on CPU, 2 ranks.

python bench/deepspeed_presets.py [--steps 12] [--n-embd 512] [--n-layer 4] [--nvme-path DIR]

Each preset runs once through the real `launch` console script (logger=none), the same GPT on the
same synthetic tokens: micro-batch 4, global batch 16 (accumulation 2), fp32, AdamW. Step time is
the median over the logged steps after the first (warm-up); model-state bytes are the per-rank
figure the strategy reports at the last step (device side; offloaded state in its own column).
512-wide layers make ZeRO-Infinity page for real (DeepSpeed keeps tensors under 1 MiB in memory).
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
PRESETS = ["ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero_infinity"]
MIB = 2**20


def run(preset: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    run_dir = out / preset
    extra = [f"strategy.nvme_path={args.nvme_path or out}"] if preset == "zero_infinity" else []
    proc = subprocess.run(
        [
            LAUNCH,
            f"strategy={preset}",
            *extra,
            "model=gpt_tiny",
            f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}",
            "model.n_head=8",
            "data=synthetic",
            "data.seq_len=64",
            "gpus=2",
            "device=cpu",
            "batch.global_size=16",
            "batch.micro_size=4",
            f"trainer.max_steps={args.steps}",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=out,
    )
    if proc.returncode:
        sys.exit(f"{preset} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
        "bytes": rows[-1]["model_state_bytes"],
        "offloaded": rows[-1].get("offloaded_state_bytes", 0.0),
        "loss": rows[-1]["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--nvme-path", default=None, help="folder ZeRO-Infinity pages into (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {}
        for preset in PRESETS:
            figures[preset] = run(preset, args, Path(tmp))
            print(f"{preset}: done", file=sys.stderr, flush=True)
    base = figures["ddp"]
    print(
        f"GPT {args.n_layer} x {args.n_embd}, 2 CPU ranks, micro 4 x accumulation 2, fp32 AdamW, {args.steps} steps\n"
    )
    print(
        "| preset | median step time (s) | x DDP | model state per rank (MiB) | x DDP "
        "| offloaded per rank (MiB) | last loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for preset, f in figures.items():
        print(
            f"| {preset} | {f['step_s']:.3f} | {f['step_s'] / base['step_s']:.2f} | {f['bytes'] / MIB:.1f} | "
            f"{f['bytes'] / base['bytes']:.3f} | {f['offloaded'] / MIB:.1f} | {f['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
