"""The configured optimizer, built over the trainable parameters in param groups (fused where it can be); its
learning-rate schedule is `launcher.optim.schedules`."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from launcher.optim.grouped import TARGET, Grouped
from launcher.optim.groups import RECIPE_KEYS, Rule, hidden_rule, param_groups, rules_of
from strategies import RunContext


def optimizer_factory(cfg: DictConfig, ctx: RunContext) -> functools.partial[Any]:
    """The configured optimizer as a partial over a module (strategies may read its keywords), built by
    `build_optimizer` in the param groups of optim's rules (`launcher.optim.groups`).

    The fused kernel where the optimizer has one (torch's Adam, AdamW, SGD, Adagrad), the user did not choose, and
    the parameters take it: one pass over each parameter, in place, on CUDA and on the CPU alike. The per-tensor loop
    it replaces allocates temporaries as large as the tensor it steps, which for DeepSpeed's flat partitions is the
    whole partition.
    """
    partial = instantiate(optimizer_node(cfg.optim), _partial_=True, _convert_="all")
    rules = rules_for(cfg.optim, partial.func)
    if partial.args:  # positional hyperparameters: called as configured
        return functools.partial(build_optimizer, partial, rules=rules)
    fusable = "fused" in inspect.signature(partial.func).parameters and "fused" not in partial.keywords
    # Not under fp16's loss scaler on the CPU: the fused CPU kernels reject the scaler's found-inf tensor's shape.
    fuse = fusable and (ctx.device_type == "cuda" or (ctx.device_type == "cpu" and ctx.precision != "fp16"))
    return functools.partial(build_optimizer, partial.func, rules=rules, fuse=fuse, **partial.keywords)


def optimizer_node(optim: DictConfig) -> DictConfig:
    """The optim node less the keys the launcher reads itself (`RECIPE_KEYS`): what the optimizer is called with."""
    return OmegaConf.masked_copy(optim, [k for k in optim if k not in RECIPE_KEYS])


def rules_for(optim: DictConfig, optimizer: Any) -> list[Rule]:
    """optim's grouping rules; without the no-decay rule where the optimizer takes no weight decay."""
    rules = rules_of(optim)
    if getattr(optimizer, "HIDDEN_MATRICES", None):  # optim=muon: its own group before the default's
        keys = {optimizer.HIDDEN_MATRICES: True, "lr_scale": float(optim.muon_lr) / float(optim.lr)}
        rules.insert(next(i for i, r in enumerate(rules) if r.builtin), hidden_rule(keys))
    try:
        takes = "weight_decay" in inspect.signature(optimizer).parameters
    except (TypeError, ValueError):
        takes = True
    return rules if takes else [r for r in rules if r.label != "no_decay"]


def build_optimizer(
    optimizer: type[torch.optim.Optimizer],
    params: Any,
    rules: list[Rule] | None = None,
    fuse: bool = False,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """`optimizer(params, **kwargs)` over the trainable parameters only, as DeepSpeed's ZeRO optimizers hold them: a
    frozen parameter has no optimizer state in any strategy, and a checkpoint's param groups load under every one.
    `params` is a module (its parameters in the param groups of `rules`, `launcher.optim.groups`), or
    parameters or param groups as torch takes them.

    With `fuse`, the fused kernel, unless a parameter is a DTensor (FSDP's shards) and DTensor has no sharding rule
    for the optimizer's fused kernel (torch 2.13: Adam's and AdamW's only; SGD's and Adagrad's fail in the first
    step). Decided from the parameters themselves, whichever strategy built them."""
    from torch.distributed.tensor import DTensor

    if isinstance(params, torch.nn.Module):
        params = param_groups(params, rules or rules_of({}), kwargs.get("lr"))
    groups = [
        {**item, "params": [p for p in item["params"] if p.requires_grad]} if isinstance(item, dict) else item
        for item in params
        if isinstance(item, dict) or item.requires_grad
    ]
    flat = [p for item in groups for p in (item["params"] if isinstance(item, dict) else [item])]
    if fuse and (not any(isinstance(p, DTensor) for p in flat) or _dtensor_fuses(optimizer)):
        kwargs["fused"] = True
    if any(isinstance(g, dict) and g.get(TARGET) for g in groups):  # a rule of optim.groups naming its optimizer
        return Grouped(groups, optimizer, **kwargs)
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
