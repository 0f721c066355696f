"""A batch moved to a device, whatever its shape: what the data hands each rank, and what the launcher's check of the
model runs on the meta device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(obj: Any, device: torch.device) -> Any:
    """A batch on `device`: tensors copied (pinned and without blocking on CUDA), mappings, lists, tuples and named
    tuples rebuilt around their moved parts, objects with `.to(device)` moving themselves; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return (obj if obj.is_pinned() else obj.pin_memory()).to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [to_device(v, device) for v in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    move = getattr(obj, "to", None)
    if callable(move) and not isinstance(obj, (str, bytes, type)):
        return move(device)
    return obj
