"""Non-finite steps: a step whose loss (on any rank) or global gradient norm is NaN or Inf is never committed.

How, without a collective of its own in a finite step: each micro-step's loss goes to the backward multiplied by 1
where it is finite and by NaN where it is not, so a non-finite loss on any rank makes the synchronised gradient, and
so the global gradient norm every rank computes, non-finite on every rank. Every strategy leaves a step whose global
norm is not finite uncommitted: no parameter and no optimizer state changes (`Strategy.step`; under fp16 the loss
scaler skips it itself). Only then, on every rank at once, the ranks gather which of them saw a non-finite loss, and
`trainer.nonfinite` stops the run (one line: the step, the micro-step, the ranks) or skips the step, up to
`trainer.max_skipped` in a row. Under fp16 a non-finite norm with every loss finite is the scaler's overflow, as before.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from strategies import Strategy


class NonFiniteError(RuntimeError):
    """A step that was not finite ended the run (trainer.nonfinite=stop, or trainer.max_skipped in a row)."""


class Guard:
    """The strategy as the optimizer step sees it, with each micro-step's loss recorded and made to poison the
    gradient when it is not finite; `judge` decides, after the step, what a non-finite step means for the run."""

    def __init__(self, strategy: Strategy, mode: str, max_skipped: int, fp16: bool, rank: int, world_size: int) -> None:
        self.strategy, self.mode, self.max_skipped = strategy, mode, max_skipped
        self.fp16, self.rank, self.world_size = fp16, rank, world_size
        self.skipped = 0
        """Steps skipped so far (trainer.nonfinite=skip)."""
        self.in_a_row = 0
        self._losses: list[torch.Tensor] = []
        if callable(getattr(strategy, "pipeline_step", None)):  # a pipeline: its last stage's losses, guarded alike
            self.pipeline_step = self._pipeline_step

    def _pipeline_step(self, micro: list[Any], loss_of: Any) -> Any:
        """A pipeline's step (`strategies.pipeline`): each micro-batch's loss, on the last stage, recorded and made to
        poison the gradient as `backward` does; a stage that computes no loss records a finite zero for it."""
        self._losses = [torch.zeros(()) for _ in micro]

        def guarded(k: int, output: Any) -> Any:
            backward, part, normalised = loss_of(k, output)
            value = backward.detach()
            self._losses[k] = value
            factor = torch.where(torch.isfinite(value), 1.0, math.nan).to(backward.dtype)
            return backward * factor, part, normalised

        return self.strategy.pipeline_step(micro, guarded)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.strategy, name)

    def forward(self, batch: Any) -> Any:
        return self.strategy.forward(batch)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return self.strategy.sync(enabled)

    def backward(self, loss: torch.Tensor) -> None:
        value = loss.detach()
        self._losses.append(value)
        # x 1 (exact) where finite; x NaN where not: the gradient of every parameter it reaches becomes NaN.
        factor = torch.where(torch.isfinite(value), 1.0, math.nan).to(loss.dtype)
        self.strategy.backward(loss * factor)

    def step(self, lr: float) -> float:
        return self.strategy.step(lr)

    def judge(self, step: int, grad_norm: float) -> bool:
        """After optimizer step `step` (called on every rank): True if it was committed. A non-finite one raises
        NonFiniteError under trainer.nonfinite=stop, or after trainer.max_skipped of them in a row."""
        losses, self._losses = self._losses, []
        if math.isfinite(grad_norm):  # the same global norm on every rank: they all agree without a collective
            self.in_a_row = 0
            return True
        mine = next(((k, float(v)) for k, v in enumerate(torch.stack(losses).tolist()) if not math.isfinite(v)), None)
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, mine)  # every rank is here: they all saw the same non-finite norm
        bad = [(rank, *found) for rank, found in enumerate(seen) if found is not None]  # (rank, micro-step, loss)
        if self.fp16 and not bad:
            return True  # the loss scaler's overflow: it skipped the step and lowered its scale, as it always does
        K = len(losses)
        if bad:
            what = "; ".join(f"the loss is {v} on rank {r} (micro-step {k + 1}/{K})" for r, k, v in bad)
        else:
            what = f"the gradient norm is {grad_norm} though every rank's loss is finite"
        if self.mode == "stop":
            raise NonFiniteError(
                f"step {step} is not finite: {what}; nothing of it was applied, and the newest checkpoint is the "
                "last finite one; lower optim.lr or raise trainer.warmup_steps, or set trainer.nonfinite=skip to "
                "drop such steps"
            )
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        if self.in_a_row >= self.max_skipped:
            raise NonFiniteError(
                f"{self.in_a_row} steps in a row were not finite (trainer.max_skipped={self.max_skipped}), the last "
                f"step {step}: {what}; the newest checkpoint is the last finite one"
            )
        if self.rank == 0:
            print(
                f"launch: skipped step {step}: {what} ({self.in_a_row} in a row, trainer.max_skipped="
                f"{self.max_skipped})",
                flush=True,
            )
        return False
