"""Counting the gradient-synchronisation collectives a strategy issues, for its `metrics()`.

Generic on purpose: a strategy calls `record` from wherever its framework lets it observe a
collective (a DDP comm hook, FSDP2's custom reduce-scatter, a wrapped DeepSpeed comm call).
"""

from __future__ import annotations

import torch


class CommCounter:
    """Collectives issued and their payload bytes since the last `take()`."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def record(self, payload: torch.Tensor) -> None:
        """One collective whose input is `payload` (counted at its dtype: what goes on the wire)."""
        self.calls += 1
        self.bytes += payload.numel() * payload.element_size()

    def take(self) -> dict[str, float]:
        """The counts as `comm_calls`/`comm_bytes` metrics, then start again from zero."""
        counts = {"comm_calls": self.calls, "comm_bytes": self.bytes}
        self.calls = self.bytes = 0
        return counts
