"""Bytes a rank holds: a tensor's local part (a DTensor's shard), every tensor in a state, and a model's state with
its optimizer's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor this rank holds: a DTensor's local shard only."""
    if hasattr(t, "to_local"):  # DTensor: count only this rank's shard
        t = t.to_local()
    return t.numel() * t.element_size()


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples (a state dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def model_state_bytes(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    which: Callable[[torch.Tensor], bool] | None = None,
) -> int:
    """Bytes of parameters, gradients and optimizer state that this rank holds (local shards only): of every
    parameter, or of those `which` selects (with their gradients and their optimizer state)."""
    total = 0
    for p in params:
        if which is not None and not which(p):
            continue
        total += local_bytes(p)
        if p.grad is not None:
            total += local_bytes(p.grad)
        total += sum(local_bytes(t) for t in tensors(optimizer.state.get(p, {})) if t.dim() > 0)
    return total
