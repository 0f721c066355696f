"""Pipeline parallel on CPU: PP=2 (1F1B, 2 gloo ranks, one stage each) against one process, the same global batch,
at M = 2, 4 and 8 micro-batches per step, beside the plan's bubble.

python bench/pipeline.py [--steps 8] [--repeats 1] [--schedule 1f1b]

Each row runs through the real `launch`: a 4 x 256 GPT (2 layers per stage), random tokens, sequence 64,
micro-batch 2, global batch 2M, fp32. Step time is the median of the per-step `step_time_s` in metrics.jsonl, step 1
(lazy initialisation, torch's shape inference) left out. With the bubble alone, P stages of a model whose one-process
step takes t run a step in (M + P - 1) x t / (M x P) (1F1B, a stage 1/P of the work): the planned ratio against one
process, (M + P - 1) / (M x P), is 0.75, 0.625 and 0.5625 at P = 2. The measured ratio adds what the plan leaves out:
the hidden states sent over loopback (`pp_sent_bytes`, printed), FSDP2's wrapping of each stage, and on a 2-core
machine the cores the one process also uses for its own intra-op threads.
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
MICRO = 2
JOB = [
    "model=gpt_tiny",
    "model.n_layer=4",
    "model.n_embd=256",
    "model.n_head=4",
    "data=synthetic",
    "data.seq_len=64",
    "device=cpu",
    f"batch.micro_size={MICRO}",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.save_at_end=false",
    "trainer.progress=false",
    "logger=none",
]


def run(overrides: list[str], steps: int, out: Path) -> dict[str, float]:
    run_dir = out / f"run-{len(list(out.iterdir()))}"
    cmd = [LAUNCH, *JOB, *overrides, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=out)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"step": statistics.median(r["step_time_s"] for r in rows[1:]), "sent": rows[-1].get("pp_sent_bytes", 0.0)}


def main() -> None:
    from launcher.plan.pipeline import bubble

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    a = p.parse_args()
    P = 2
    print("| M | one process (s) | PP=2 (s) | measured PP / one | planned PP / one | bubble | sent per rank (MB) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for M in (2, 4, 8):
            size = f"batch.global_size={M * MICRO}"
            one, pp = [], []
            for _ in range(a.repeats):  # alternating: drifting load hits both rows alike
                one.append(run([size, "strategy=fsdp", "gpus=1"], a.steps, Path(tmp)))
                pp.append(
                    run(
                        [
                            size,
                            "strategy=fsdp",
                            f"strategy.pp_size={P}",
                            f"strategy.pp_schedule={a.schedule}",
                            "gpus=2",
                        ],
                        a.steps,
                        Path(tmp),
                    )
                )
            t1, tp = (statistics.median(r["step"] for r in rows) for rows in (one, pp))
            planned = (M + P - 1) / (M * P)
            print(
                f"| {M} | {t1:.4f} | {tp:.4f} | {tp / t1:.3f} | {planned:.3f} | {bubble(a.schedule, P, M):.1%} | "
                f"{pp[-1]['sent'] / 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
