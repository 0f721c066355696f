"""Communication: the ring formula, and a counter of the collectives a strategy issues, for its `metrics()`.

The formula lives here, beside the counter that measures against it; the planner imports it from here.
The counter is generic on purpose: a strategy calls `record` from wherever its framework lets it observe a
collective (a DDP comm hook, FSDP2's custom reduce-scatter, a wrapped DeepSpeed comm call).
"""

from __future__ import annotations

import torch

RING_PASSES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "reduce": 1, "all_to_all": 1}
"""Ring passes per collective: an all-reduce is a reduce-scatter then an all-gather; an all-to-all sends each other
rank its (G-1)/G share of the buffer once."""


def ring_sent_elements(elements: float, world_size: int, collective: str = "all_reduce") -> float:
    """Elements each rank sends in a ring collective over a buffer of `elements`: (G-1)/G of it per pass."""
    return RING_PASSES[collective] * (world_size - 1) / world_size * elements


class CommCounter:
    """Collectives issued, their payload bytes, and the ring bytes this rank sent, since the last `take()`.

    The payload is the buffer handed to the collective (P x element bytes for DDP's all-reduce); what a rank
    sends in a ring is a fraction of it: 2(G-1)/G for an all-reduce, (G-1)/G for a reduce-scatter or an
    all-gather. The planner's formula counts sent bytes, so `comm_sent_bytes` is the figure to compare with it.
    """

    def __init__(self) -> None:
        self.world_size = 1
        """Set by the strategy in setup: the ring's length (HSDP: its shard group's)."""
        self.calls = 0
        self.bytes = 0
        self.sent = 0.0
        self.recorded = 0
        """Calls that came through `record` (and so named their collective): `sent` covers only those."""

    def record(
        self, payload: torch.Tensor | int, collective: str = "all_reduce", sync: bool = True, ranks: int | None = None
    ) -> None:
        """One collective over the full buffer `payload` (a tensor, at its dtype: what goes on the wire; or its bytes).

        `sync`: it synchronises gradients (counted in `comm_calls`/`comm_bytes`); a parameter all-gather is not, and
        counts only in the bytes sent. `ranks`: the ring's length when the collective runs over a group of its own
        (HSDP's all-reduce across the replicas); unset: `world_size`."""
        nbytes = payload if isinstance(payload, int) else payload.numel() * payload.element_size()
        if sync:
            self.calls += 1
            self.recorded += 1
            self.bytes += nbytes
        self.sent += ring_sent_elements(nbytes, ranks or self.world_size, collective)

    def take(self) -> dict[str, float]:
        """The counts as `comm_calls`/`comm_bytes`(/`comm_sent_bytes`) metrics, then start again from zero."""
        counts: dict[str, float] = {"comm_calls": self.calls, "comm_bytes": self.bytes}
        if self.recorded == self.calls:  # a caller that bumps calls/bytes directly names no collective: no sent figure
            counts["comm_sent_bytes"] = self.sent
        self.calls = self.bytes = self.recorded = 0
        self.sent = 0.0
        return counts
