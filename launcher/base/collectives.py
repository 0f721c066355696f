"""The few collectives of plain figures that the loop, the evaluation and the telemetry share: a sum or max of a
few floats over ranks, and every rank's row of them, in one collective each."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather_rows(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on each), a row per rank in rank order: one collective."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)  # flat: gloo's shape
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(rows, mine)  # torch 2.13 renamed it
    return rows.view(-1, len(values)).tolist()
