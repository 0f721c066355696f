"""FSDP vs DDP on 2 CPU ranks: median step time and model-state bytes per rank, for two model sizes.

python bench/fsdp_vs_ddp.py [--steps 12] [--repeats 1]

Rows: DDP, FSDP as configured by default, and FSDP with reshard_after_forward=false (which trades
holding gathered parameters from forward to backward for one all-gather fewer per unit).

Each run goes through the real `launch` console script (logger=none, random tokens, sequence 64,
micro-batch 2, global batch 8: 2 micro-steps per optimizer step). Step time is the median of the
per-step `step_time_s` in metrics.jsonl, step 1 (lazy initialisation) left out. Model-state bytes
are the strategy's own figure: parameters + gradients + optimizer state held by one rank. The two
strategies alternate within one invocation, so drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import launch_rows  # noqa: E402  (bench/ is scripts, not a package)

MODELS = {  # name -> (n_layer, n_embd, n_head)
    "gpt_tiny (4 x 128)": (4, 128, 4),
    "gpt 12 x 512": (12, 512, 8),
}
STRATEGIES = {  # row name -> overrides
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    # Keeps each unit gathered from forward to backward: one all-gather per micro-step instead of two.
    "fsdp, reshard_after_forward=false": ["strategy=fsdp", "strategy.reshard_after_forward=false"],
}


def parameters(n_layer: int, n_embd: int, n_head: int) -> int:
    import torch

    from launcher.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=256, block_size=64)
    return sum(p.numel() for p in model.parameters())


def run(overrides: list[str], shape: tuple[int, int, int], steps: int, out: Path) -> tuple[list[float], float]:
    n_layer, n_embd, n_head = shape
    model = [f"model.n_layer={n_layer}", f"model.n_embd={n_embd}", f"model.n_head={n_head}"]
    batch = ["data.seq_len=64", "batch.global_size=8", "batch.micro_size=2"]
    run_dir = out / f"run-{len(list(out.iterdir()))}"
    rows = launch_rows([*overrides, *model, *batch, f"trainer.max_steps={steps}", "trainer.log_every=1"], run_dir)
    return [r["step_time_s"] for r in rows[1:]], rows[-1]["model_state_bytes"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    state: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, shape in MODELS.items():
            for _ in range(a.repeats):
                for strategy in STRATEGIES:
                    steps, state[strategy, model] = run(STRATEGIES[strategy], shape, a.steps, Path(tmp))
                    times.setdefault((strategy, model), []).extend(steps)
    median = {key: statistics.median(v) for key, v in times.items()}
    print("| model | params | strategy | median step time (s) | model-state bytes per rank |")
    print("|---|---|---|---|---|")
    for model, shape in MODELS.items():
        n = parameters(*shape)
        for strategy in STRATEGIES:
            print(
                f"| {model} | {n / 1e6:.2f} M | {strategy} | {median[strategy, model]:.4f} | "
                f"{state[strategy, model] / 2**20:.1f} MiB |"
            )
    print("\n| model | FSDP variant | step time FSDP / DDP | model-state bytes FSDP / DDP |")
    print("|---|---|---|---|")
    for model in MODELS:
        for strategy in STRATEGIES:
            if strategy != "ddp":
                print(
                    f"| {model} | {strategy} | {median[strategy, model] / median['ddp', model]:.2f} | "
                    f"{state[strategy, model] / state['ddp', model]:.3f} |"
                )


if __name__ == "__main__":
    main()
