"""What validation metrics cost: one evaluation pass with two metrics against the same pass without them.

python bench/evaluation.py [--batches 8] [--repeats 5] [--seq-len 128]

One process (a gloo group of one), the built-in GPT (model=gpt_tiny's sizes: 4 layers, 128 wide, 256 ids) on random
tokens, `--batches` global batches of 32 samples in micro-batches of 8: the evaluation's own pass
(`launcher.evaluation.passes.validate`: forward, the loss by the training step's rule, and the metrics, reduced over
ranks), timed `--repeats` times in turns after one warm-up, on one thread. The two metrics: torchmetrics'
`Perplexity` over the logits, and a function of sums and counts (next-token accuracy). Printed: the median seconds
of each, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist


def right(output: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Next-token accuracy: (predictions that are right, targets)."""
    targets = batch[1]
    return (output["logits"].argmax(dim=-1) == targets).sum(), targets.numel()


class Plain:
    """The strategy's two parts a pass calls: the model as it is."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def forward(self, batch: Any) -> Any:
        from strategies.base import call_model

        return call_model(self.model, batch)


def timed(strategy: Plain, source: Any, ctx: Any, batches: int, two: dict[str, Any], repeats: int) -> list[float]:
    """The median seconds of a pass without metrics and with `two`, measured in turns (a load that drifts over the
    run weighs on both alike), after one warm-up of each."""
    from launcher.evaluation.passes import validate
    from launcher.models.loss import LabelRule

    times: list[list[float]] = [[], []]
    for repeat in range(repeats + 1):
        for i, metrics in enumerate(({}, two)):
            started = time.perf_counter()
            validate(strategy, source, ctx, batches, LabelRule(), metrics)
            if repeat:
                times[i].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    a = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)  # one core's figures: steadier on a shared machine, the same ratio
    from omegaconf import OmegaConf

    from launcher.data.builtin import build_dataset
    from launcher.data.collate import build_collate
    from launcher.data.sources import source_of
    from launcher.evaluation.metrics import build_metrics
    from launcher.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=a.seq_len)
    data = OmegaConf.create(
        {
            "_target_": "launcher.data.builtin.Synthetic",
            "seq_len": a.seq_len,
            "vocab_size": 256,
            "num_samples": 4096,
            "format": "tuple",
        }
    )
    source = source_of(build_dataset(data, "val"), 32, 0, build_collate(None), "the val split")
    ctx = SimpleNamespace(device="cpu", rank=0, world_size=1, accumulation=4)
    two = build_metrics({"ppl": {"_target_": "torchmetrics.text.Perplexity"}, "right": {"_target_": "__main__.right"}})
    two = {name: m.to(torch.device("cpu")) for name, m in two.items()}
    strategy = Plain(model)
    without, with_two = timed(strategy, source, ctx, a.batches, two, a.repeats)
    print(f"evaluation pass, {a.batches} global batches of 32 x {a.seq_len} tokens, one process, CPU:")
    print(f"  without metrics      {without:.3f} s")
    print(f"  Perplexity + a sum   {with_two:.3f} s")
    print(f"  ratio                {with_two / without:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
