"""A model's and its optimizer's state as torch's own state dicts (the EMA's beside them), and loading them back:
what a strategy without sharded state saves and loads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strategies.ema import EMA


def torch_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None = None) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names, whatever the wrapper (DDP, FSDP2): the checkpoint shape;
    with the EMA, its average under `ema` (the same names, held as the parameters are)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer)
    if fresh:
        # Before the first step torch makes the optimizer's state to describe it: a zero-gradient step at lr 0, which
        # counts as a step (AdamW's bias correction would then be one step ahead). Asked before training (the room a
        # checkpoint needs), the optimizer is left as fresh as it was; what was returned still describes the state.
        optimizer.state.clear()
    return {"model": model_state, "optim": optim_state} | ({"ema": ema.state()} if ema is not None else {})


def load_torch_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], ema: EMA | None = None
) -> None:
    """`state` is this strategy's template filled from a checkpoint (every model entry is there, or the load failed):
    not strict, so that a parameter the checkpoint has no optimizer state for (it never got a gradient) gets none.
    From a checkpoint without EMA weights (`launcher.checkpoint.loading` drops the entry) the average starts at the
    loaded weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(strict=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    if ema is not None:
        ema.load(state["ema"] if "ema" in state else {"weights": dict(ema.live), "steps": ema.steps})
