"""The exponential moving average of the trainable parameters (EMA weights), kept by a strategy beside the parameters
and held as it holds them: a full fp32 copy per rank where each rank holds whole parameters (DDP, ZeRO-1/2), the
rank's shard where parameters are sharded (FSDP's DTensors, ZeRO-3's partitions).

After optimizer step t (counted from 1, the steps applied): up to `start` the average is the parameters themselves;
after it, every `every` steps, average = decay x average + (1 - decay) x parameters, in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class EMASettings:
    """trainer.ema as plain values: what a strategy needs to keep the average."""

    decay: float
    every: int = 1
    start: int = 0


class EMA:
    """The average of `live` (name -> the tensor this rank holds of each trainable parameter: its values, in place)."""

    def __init__(self, live: dict[str, torch.Tensor], settings: EMASettings) -> None:
        self.live, self.settings = live, settings
        with torch.no_grad():
            self.average = {n: t.detach().to(torch.float32, copy=True) for n, t in live.items()}
        self.steps = torch.zeros((), dtype=torch.int64)
        """Optimizer steps applied so far (a tensor: saved with the average, so a resume goes on counting)."""

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step that was applied."""
        self.steps += 1
        t, s = int(self.steps), self.settings
        if t <= s.start:
            for n, live in self.live.items():
                self.average[n].copy_(live)
        elif (t - s.start) % s.every == 0:
            for n, live in self.live.items():
                self.average[n].lerp_(live.to(torch.float32), 1 - s.decay)

    def state(self) -> dict[str, object]:
        """The checkpoint's `ema` entry: the average's own tensors (a load fills them in place) and the step count."""
        return {"weights": self.average, "steps": self.steps}

    @torch.no_grad()
    def load(self, state: dict[str, object]) -> None:
        weights = state["weights"]
        assert isinstance(weights, dict)
        for n, t in self.average.items():
            if weights[n] is not t:
                t.copy_(weights[n])
        self.steps.copy_(torch.as_tensor(state["steps"]))

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The parameters hold the average inside the block (rounded to their dtype), their own values after it."""
        with torch.no_grad():
            saved = {n: t.detach().clone() for n, t in self.live.items()}
            for n, live in self.live.items():
                live.copy_(self.average[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, live in self.live.items():
                    live.copy_(saved[n])


@contextmanager
def averaged(ema: EMA | None) -> Iterator[bool]:
    """A strategy's `averaged` over its EMA (or none)."""
    if ema is None:
        yield False
        return
    with ema.swapped():
        yield True


def ema_of(module: nn.Module, settings: EMASettings | None) -> EMA | None:
    """The EMA of a module's trainable parameters (by their checkpoint names), held as the parameters are."""
    if settings is None:
        return None
    return EMA({n: p for n, p in module.named_parameters() if p.requires_grad}, settings)
