"""One optimizer step over this rank's micro-batches, by the loss rule of `launcher.models.loss`:
the arithmetic of a step, with no state of the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from launcher.base.collectives import all_reduce
from launcher.models.loss import (
    NUM_ITEMS,
    LabelRule,
    count_targets,
    micro_loss,
    say_once,
    usual_recipe_line,
)
from launcher.worker.lifecycle import Phase
from strategies import RunContext, Strategy
from strategies.pipeline import pipelined

if TYPE_CHECKING:
    from launcher.telemetry.stragglers import StepClock


def train_step(
    strategy: Strategy,
    micro: list[Any],
    ctx: RunContext,
    rule: LabelRule,
    *,
    lr: float,
    step: int,
    phase: Phase,
    clock: StepClock | None = None,
    seen: Any = None,
) -> tuple[torch.Tensor, float]:
    """One optimizer step over this rank's K micro-batches; returns this rank's part of the step's loss (summed over
    ranks it is the loss of the whole global batch: `launcher.models.loss`) and the pre-clip gradient norm. `clock` (a
    logged step's): this rank's seconds in the step's first collective and in a probe before the last backward
    (`launcher.telemetry.stragglers`)."""
    device, K = torch.device(ctx.device), len(micro)

    def reduce(values: list[float]) -> list[float]:  # the step's first collective: a logged step times its wait
        if clock is None:
            return all_reduce(values, dist.ReduceOp.SUM, device)
        return clock.waiting(lambda: all_reduce(values, dist.ReduceOp.SUM, device))

    if clock is not None:
        clock.batches_read()
    # The global batch's targets, counted before the first forward: each micro-step's loss is scaled so that the
    # step's gradient is that of one forward over the whole global batch.
    targets = count_targets(micro, ctx.world_size, reduce, rule.label_shift)
    divided = targets.counted and rule.takes_num_items and all(targets.labels)
    loss_sum, normalised = torch.zeros((), dtype=torch.float64, device=device), False
    if pipelined(strategy):  # the strategy runs the K micro-steps itself, as a pipeline's microbatches
        phase(f"in the pipeline schedule of step {step}, {K} micro-batches")
        if clock is not None:
            clock.probe()
        loss_sum, normalised = strategy.pipeline_step(  # type: ignore[attr-defined]
            micro, lambda k, output: micro_loss(output, k, targets, K, False, rule.loss_at)
        )
        micro = []
    for k, batch in enumerate(micro):
        phase(f"in forward/backward of step {step}, micro-step {k + 1}/{K}")
        if divided:  # a transformers model divides its summed loss by this itself
            batch = {**batch, NUM_ITEMS: targets.total / ctx.world_size}
        # Gradients are synchronised once per optimizer step: on the last micro-step only.
        with strategy.sync(k == K - 1):
            output = strategy.forward(batch)
            if seen is not None:  # data=mix on a logged step: each source's loss (`launcher.mixture.source_loss`)
                seen(k, output, batch)
            if clock is not None and k == K - 1:  # before the gradient sync: a slow forward is waited for here
                clock.probe()
            backward, part, normalised = micro_loss(output, k, targets, K, divided, rule.loss_at)
            strategy.backward(backward)
        loss_sum += part.double()
    if not normalised and ctx.rank == 0:
        say_once(usual_recipe_line(targets))
    phase(f"in the optimizer step {step}")
    grad_norm = strategy.step(lr)
    if clock is not None:
        clock.stop()
    return loss_sum / (targets.total if normalised else ctx.world_size), grad_norm
