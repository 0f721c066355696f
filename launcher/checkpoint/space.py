"""How much room a checkpoint takes, counted before it is written, and the check that the room is there."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher.base.durable import disk
from launcher.checkpoint.format import rng_state

ENTRY_BYTES = 2048
"""Bytes DCP writes per state entry beyond its data: torch.save's archive around each one (about 1.6 kB) and its
record in `.metadata`."""
BLOCK = 4096
"""A file's last, partly used block, per file of a checkpoint."""


def checkpoint_bytes(state: dict[str, Any], world_size: int) -> int:
    """The bytes a checkpoint of `state` takes on disk, counted as DCP writes them: each tensor once (a replicated
    tensor by one rank, each shard of a DTensor once: its global size), each entry's header, every rank's RNG file
    and every file's last block. The same figure on every rank."""
    import torch

    entries = list(_leaves(state))
    data = sum(t.numel() * t.element_size() for t in entries if isinstance(t, torch.Tensor))  # DTensor: global
    rng = io.BytesIO()
    torch.save(rng_state(), rng)
    files = 2 * world_size + 2  # a .distcp and an RNG file per rank, .metadata, manifest.json
    return data + ENTRY_BYTES * len(entries) + world_size * len(rng.getbuffer()) + BLOCK * files


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, (dict, list, tuple)) for v in obj):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def check_space(checkpoints: Path, size: int, count: int, what: str, after: str = "") -> None:
    """Collective: room for `count` checkpoints of `size` bytes in the free space rank 0 sees (the folder is shared);
    RuntimeError (one line: the disk, `what` needs room, `after`) on every rank if there is not."""
    import torch
    import torch.distributed as dist

    here = shutil.disk_usage(checkpoints).free if dist.get_rank() == 0 else 0
    free = torch.tensor([float(here)], dtype=torch.float64)
    dist.broadcast(free, src=0)
    if free.item() < size * count:
        raise RuntimeError(
            f"no room on {disk(checkpoints)} for {what} ({count} x {size / 1e6:,.1f} MB){after}; free space there, "
            "lower trainer.keep_last, or choose another hydra.run.dir"
        )
