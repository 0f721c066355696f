"""The optimizer step every strategy takes the same way: the schedule's rate per group (`LR_SCALE`), the clip by
the global gradient norm, the step, the EMA's update; the precision's autocast dtype and the loss scaler's scale; and
a step's figures (state bytes, bytes sent)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from strategies.comm import CommCounter
from strategies.ema import EMA
from strategies.sizes import model_state_bytes

LR_SCALE = "lr_scale"
"""A param group's factor of the schedule's learning rate (1 where a group has none)."""


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's learning rate, times each group's `LR_SCALE`."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get(LR_SCALE, 1.0)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    grad_clip: float,
    lr: float,
    offloaded_to_host: Callable[[torch.Tensor], bool] | None = None,
    ema: EMA | None = None,
) -> tuple[float, int, int]:
    """The optimizer step of the torch strategies (DDP, FSDP): set the learning rate, unscale, clip to the global
    norm, step, update the loss scaler, zero the gradients. A non-finite global norm is not committed: the optimizer
    does not step (under fp16 the scaler skips it itself, and lowers its scale).

    Returns the pre-clip global gradient norm, the model-state bytes this rank held at the step (measured before the
    gradients are released: the step's peak), and of those the bytes of the parameters `offloaded_to_host` selects.
    On DTensor gradients (FSDP) the norm is reduced over all shards, so it is the same global norm as DDP's.
    """
    set_lr(optimizer, lr)
    scaler.unscale_(optimizer)
    limit = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = float(norm)  # the same on every rank: they all commit the step, or none does
    if math.isfinite(norm) or scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    if ema is not None and math.isfinite(norm):  # the step was applied
        ema.update()
    held = model_state_bytes(model.parameters(), optimizer)
    offloaded = model_state_bytes(model.parameters(), optimizer, offloaded_to_host) if offloaded_to_host else 0
    optimizer.zero_grad(set_to_none=True)
    return norm, held, offloaded


def scaler_scale(scaler: Any) -> float | None:
    """The loss scale after the step's update, when the scaler runs (precision=fp16): halved on each overflow."""
    return float(scaler.get_scale()) if scaler.is_enabled() else None


def step_figures(
    counter: CommCounter, on_device: float, offloaded: float | None = None, loss_scale: float | None = None
) -> dict[str, float]:
    """What every strategy's `metrics()` reports of its last optimizer step, under the names `launcher.base.metrics`
    declares: the model state it holds on the device (and offloaded, where it offloads), the loss scale under
    precision=fp16, and its counter's collectives since the last step (read and reset)."""
    figures = {"model_state_bytes": float(on_device)}
    if offloaded is not None:
        figures["offloaded_state_bytes"] = float(offloaded)
    if loss_scale is not None:
        figures["loss_scale"] = loss_scale
    return figures | counter.take()
