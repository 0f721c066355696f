"""The configured optimizer, built over the trainable parameters (fused where it can be), and its learning-rate
schedule."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from strategies import RunContext


def lr_at(step: int, base: float, warmup: int, max_steps: int, schedule: str, min_ratio: float) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warmup, then the chosen decay."""
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    progress = (step - warmup) / max(1, max_steps - warmup - 1)
    progress = min(1.0, progress)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return base * (min_ratio + (1 - min_ratio) * shape)


def optimizer_factory(cfg: DictConfig, ctx: RunContext) -> functools.partial[Any]:
    """The configured optimizer as a partial over parameters (strategies may read its keywords), built by
    `build_optimizer`.

    The fused kernel where the optimizer has one (torch's Adam, AdamW, SGD, Adagrad), the user did not choose, and
    the parameters take it: one pass over each parameter, in place, on CUDA and on the CPU alike. The per-tensor loop
    it replaces allocates temporaries as large as the tensor it steps, which for DeepSpeed's flat partitions is the
    whole partition.
    """
    partial = instantiate(cfg.optim, _partial_=True, _convert_="all")
    if partial.args:  # positional hyperparameters: called as configured
        return partial
    fusable = "fused" in inspect.signature(partial.func).parameters and "fused" not in partial.keywords
    # Not under fp16's loss scaler on the CPU: the fused CPU kernels reject the scaler's found-inf tensor's shape.
    fuse = fusable and (ctx.device_type == "cuda" or (ctx.device_type == "cpu" and ctx.precision != "fp16"))
    return functools.partial(build_optimizer, partial.func, fuse=fuse, **partial.keywords)


def build_optimizer(
    optimizer: type[torch.optim.Optimizer], params: Any, fuse: bool = False, **kwargs: Any
) -> torch.optim.Optimizer:
    """`optimizer(params, **kwargs)` over the trainable parameters only, as DeepSpeed's ZeRO optimizers hold them: a
    frozen parameter has no optimizer state in any strategy, and a checkpoint's param groups load under every one.

    With `fuse`, the fused kernel, unless a parameter is a DTensor (FSDP's shards) and DTensor has no sharding rule
    for the optimizer's fused kernel (torch 2.13: Adam's and AdamW's only; SGD's and Adagrad's fail in the first
    step). Decided from the parameters themselves, whichever strategy built them."""
    from torch.distributed.tensor import DTensor

    groups = [
        {**item, "params": [p for p in item["params"] if p.requires_grad]} if isinstance(item, dict) else item
        for item in params
        if isinstance(item, dict) or item.requires_grad
    ]
    flat = [p for item in groups for p in (item["params"] if isinstance(item, dict) else [item])]
    if fuse and (not any(isinstance(p, DTensor) for p in flat) or _dtensor_fuses(optimizer)):
        kwargs["fused"] = True
    return optimizer(groups, **kwargs)


def _dtensor_fuses(optimizer: type) -> bool:
    """Whether DTensor dispatches the optimizer's fused kernel (torch names it `_fused_<class name>_`)."""
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, f"_fused_{optimizer.__name__.lower()}_", None)
    if op is None:
        return False
    rules = DTensor._op_dispatcher.sharding_propagator  # private; checked against torch 2.13
    tables = (rules.op_strategy_funcs, rules.op_single_dim_strategy_funcs, rules.op_to_rules)
    return any(op.default in table for table in tables)
