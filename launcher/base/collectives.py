"""The few collectives of plain figures that the loop, the evaluation and the telemetry share: a sum or max of a
few floats over ranks, and every rank's row of them, in one collective each; and what a failed collective looks
like."""

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


def failed_collective(error: BaseException) -> bool:
    """An error of a collective: torch's own error types for it (NCCL's DistBackendError, the store's DistNetworkError
    and DistStoreError), or gloo's, a plain RuntimeError, raised from torch's code (a collective, or the backward that
    runs DDP's). Never a model's or a library's own error that merely says "timed out" or "connection"."""
    if isinstance(error, dist.DistError):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    inner = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return type(error) is RuntimeError and inner.split(".")[0] == "torch"
