"""Stragglers, named: on logged steps, each rank's seconds computing and waiting in the step's own collectives, and
one line when one rank keeps the others waiting.

What is timed (wall clock, on logged steps only: the other steps pay nothing): the step's first collective, the count of
the global batch's targets (`launcher.models.loss.count_targets`), and a probe, one tiny all-reduce, between the forward
and the backward of the last micro-step, before its gradients are synchronised. A rank that reads its batches slowly
makes the others wait in the first; a rank slow in its forwards (and in the backwards of the micro-steps before the
last, where those synchronise nothing: DDP, ZeRO-1 and ZeRO-2) makes them wait in the probe. A rank's `wait_s` is its
seconds in those two; its `compute_s` is the rest of the step, from the wait for its batches to the end of the optimizer
step.

What it cannot see: a collective inside the strategy's own work holds the ranks in step there, untimed, and the wait
counts as computing on every rank alike. So slowness in the last backward (DDP's gradient all-reduce, ZeRO's and
FSDP's reductions), in the optimizer step (the global gradient norm), and under FSDP or ZeRO-3 in any forward (the
parameter all-gathers keep the ranks in step inside it) shows as every rank's time, not as one rank's; under HSDP a
slow rank's whole shard group is slow alike, and no one rank of it is named. On CUDA the rank's queued device work is
waited for before each timed collective, so it counts as computing, not waiting.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from launcher.base.run_files import host_of

T = TypeVar("T")


class StepClock:
    """One logged step's seconds on this rank: made as the step starts (before its batches are read), handed to
    `launcher.worker.step.train_step`, read by the runner's figures."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = time.perf_counter()
        self.data_s = self.wait_s = self.step_s = 0.0

    def batches_read(self) -> None:
        self.data_s = time.perf_counter() - self.started

    def waiting(self, collective: Callable[[], T]) -> T:
        """`collective()`, which must return host values (so it returns once every rank has joined), its seconds
        counted as waiting."""
        self._settle()
        start = time.perf_counter()
        out = collective()
        self.wait_s += time.perf_counter() - start
        return out

    def probe(self) -> None:
        """Between the last forward and its backward: the ranks that finished their forwards first wait here."""

        def probe() -> float:
            t = torch.zeros(1, device=self.device)
            dist.all_reduce(t)
            return t.item()  # on the host: every rank has joined

        self.waiting(probe)

    def stop(self) -> None:
        self._settle()
        self.step_s = time.perf_counter() - self.started

    def _settle(self) -> None:
        if self.device.type == "cuda":  # kernels still queued are this rank's computing, not its wait
            torch.cuda.synchronize(self.device)

    def times(self) -> Times:
        return Times(self.data_s, self.wait_s, self.step_s - self.wait_s)

    def figures(self) -> dict[str, float]:
        """This rank's part of the logged figures (`launcher.base.metrics` reduces each: the largest, and whose)."""
        t = self.times()
        return {
            "compute_s_max": t.compute_s,
            "compute_s_rank": t.compute_s,
            "wait_s_max": t.wait_s,
            "wait_s_rank": t.wait_s,
        }


class Times(NamedTuple):
    """A rank's seconds in one logged step: its row in the figures' gather (`over_ranks(each=...)`)."""

    data_s: float
    """From the step's start until its batches were read (part of compute_s)."""
    wait_s: float
    compute_s: float


class Stragglers:
    """Rank 0's watch over the logged steps: a rank whose compute_s exceeds the median of the other ranks' by more
    than `fraction` in `steps` logged steps in a row is named in one line, once; again only after it has recovered
    (a logged step where it does not) and straggles for `steps` more. The median of the *other* ranks: with two
    ranks, one is compared with the other, not with their mean."""

    def __init__(self, fraction: float, steps: int, host: Callable[[int], str | None] = lambda rank: None) -> None:
        self.fraction, self.steps, self.host = fraction, steps, host
        self.recent: deque[list[Times]] = deque(maxlen=steps)
        self.streak = (-1, 0)
        """(rank, logged steps in a row it straggled)."""
        self.named: int | None = None
        """The rank last named, until it recovers."""

    @classmethod
    def of(cls, trainer: Any, run_dir: Path) -> Stragglers:
        fraction = trainer.get("straggler_fraction", 0.2) or 0.0  # 0 or null: never named
        return cls(float(fraction), int(trainer.get("straggler_steps", 3)), lambda rank: host_of(run_dir, rank))

    def slowest(self, times: list[Times]) -> int | None:
        """The rank that straggles in this step, if one does."""
        if not self.fraction or len(times) < 2:
            return None
        rank = max(range(len(times)), key=lambda r: times[r].compute_s)
        others = statistics.median(t.compute_s for r, t in enumerate(times) if r != rank)
        return rank if times[rank].compute_s > (1 + self.fraction) * others else None

    def see(self, rows: list[list[float]]) -> str | None:
        """Every rank's times of one logged step (a row per rank); the line naming a straggler, when one is due."""
        times = [Times(*row) for row in rows]
        self.recent.append(times)
        rank = self.slowest(times)
        if rank != self.named:
            self.named = None  # recovered (or another rank straggles now)
        if rank is None:
            self.streak = (-1, 0)
            return None
        self.streak = (rank, self.streak[1] + 1 if self.streak[0] == rank else 1)
        if self.streak[1] < self.steps or self.named == rank:
            return None
        self.named = rank
        return self.line(rank)

    def line(self, rank: int) -> str:
        """Where the rank spends its time, over the recent logged steps, against the other ranks' medians."""

        def per_step(of: Callable[[list[Times]], float]) -> float:
            return statistics.fmean(of(step) for step in self.recent)

        def others(field: str) -> Callable[[list[Times]], float]:
            return lambda step: statistics.median(getattr(t, field) for r, t in enumerate(step) if r != rank)

        compute, median = per_step(lambda step: step[rank].compute_s), per_step(others("compute_s"))
        data, median_data = per_step(lambda step: step[rank].data_s), per_step(others("data_s"))
        if data - median_data >= (compute - median) / 2:
            where = f"most of the difference is reading its batches ({_s(data)} against {_s(median_data)})"
        else:
            where = (
                f"the difference is in its forward/backward and optimizer step, not in reading its batches "
                f"({_s(data)} against {_s(median_data)})"
            )
        host = self.host(rank)
        return (
            f"launch: rank {rank}{f' (on {host})' if host else ''} is a straggler: {_s(compute)} computing per step "
            f"against a median of {_s(median)} on the other ranks over the last {len(self.recent)} logged steps; "
            f"{where}; the other ranks wait for it in collectives ({_s(per_step(others('wait_s')))} per step)"
        )


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"
