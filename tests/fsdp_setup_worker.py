"""Run by test_memory.py under torchrun (2 ranks): the tensors a rank's FSDP setup peaks at, as the runner measures it.

Each rank builds the strategy from the composed config, as a run does, and measures its setup with the runner's own
StepMemory. Rank 0 prints one JSON line: every rank's setup peak, the model's parameter bytes and
its largest unit's.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module

from launcher.config import freeze, schema
from launcher.config.context import make_strategy
from launcher.models.meta import build_on_meta, measure
from launcher.telemetry.peak_memory import StepMemory
from strategies import RunContext


def main(overrides: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schema.register()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = freeze(compose("config", overrides=["strategy=fsdp", *overrides]))
    from hydra.utils import instantiate

    size = measure(build_on_meta(cfg.model))
    memory = StepMemory(torch.device("cpu"))
    ctx = RunContext(
        device="cpu",
        rank=rank,
        local_rank=rank,
        world_size=world,
        precision="fp32",
        grad_clip=1.0,
        accumulation=1,
        micro_size=1,
    )
    strategy = make_strategy(cfg.strategy)

    def build_model(meta: bool = False) -> torch.nn.Module:
        return build_on_meta(cfg.model) if meta else instantiate(cfg.model)

    torch.manual_seed(0)
    with memory.measure(True):
        strategy.setup(ctx, build_model, lambda module: torch.optim.AdamW(module.parameters(), lr=1e-3))
    peaks = [None] * world
    dist.all_gather_object(peaks, memory.peak)
    if rank == 0:
        print(json.dumps({"peaks": peaks, "param_bytes": 4 * size.params, "unit_bytes": 4 * size.largest_unit}))
    strategy.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from launcher.base.process import exit_now

    exit_now(0)  # as the launcher's own workers end: a gloo thread can abort the interpreter's teardown (SIGABRT)
