"""The model contract of the runner, and the loss of an optimizer step.

A forward may return:
- the summed loss and its token count: `(loss_sum, num_tokens)`, or a dict or object with `loss_sum` and
  `num_tokens` (the built-in GPT returns a dict with both and the mean as `loss`);
- a mean: a scalar tensor, or anything with a scalar `loss` (a transformers ModelOutput, a dict with "loss").

**The loss of a step** is Σ(token losses) / Σ(target tokens) over every micro-step and rank, and its gradient is
the gradient of one forward over the whole global batch, whenever the targets can be counted: a model that
returns a sum, or a Hugging Face batch (`labels`, counted as the model uses them: shifted by one, -100 ignored).
The runner counts the global batch's targets before the first forward (one all-reduce), then backpropagates each
micro-step's summed loss times G / N: every strategy averages gradients over its G ranks, so what they hold at the
step is the gradient of (Σ sums) / N, whatever K and G — the same value DDP, FSDP and DeepSpeed alike. A model
that returns a plain mean keeps the usual recipe, mean / K averaged over ranks: exact only when every micro-batch
holds as many targets as every other (equal-length samples).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
"""Targets with this value count for nothing (torch's cross_entropy default, and transformers')."""
NUM_ITEMS = "num_items_in_batch"
"""The keyword with which a transformers model divides its summed loss itself (instead of by its own count)."""


def model_loss(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, num_tokens): a summed loss and its count when the output has both, else (the mean, None)."""
    summed = _summed(output)
    if summed is not None:
        return summed
    loss = output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss, None
    raise TypeError(
        f"the model's forward returned {_describe(output)}; return the scalar loss, an object with a scalar `loss` "
        "(a transformers ModelOutput, a dict with 'loss'), or (loss_sum, num_tokens); a transformers model needs "
        "`labels` in the batch"
    )


def _summed(output: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(output, Sequence) and not isinstance(output, (str, torch.Tensor)) and len(output) == 2:
        loss_sum, tokens = output
    elif isinstance(output, Mapping):
        loss_sum, tokens = output.get("loss_sum"), output.get("num_tokens")
    else:
        loss_sum, tokens = getattr(output, "loss_sum", None), getattr(output, "num_tokens", None)
    if isinstance(loss_sum, torch.Tensor) and loss_sum.dim() == 0 and tokens is not None:
        return loss_sum, torch.as_tensor(tokens)
    return None


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {sorted(map(str, output))} but no scalar 'loss'"
    return f"a {type(output).__name__}"


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch, for throughput: the elements of its token ids (`input_ids`, or the first tensor) when they
    are integers; 0 for batches of other data (images, features), which have no tokens to count."""
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)):
        first = batch[0] if batch else None
    else:
        first = batch
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and not first.is_complex():
        return int(first.numel())
    return 0


def target_tokens(batch: Any) -> tuple[int | None, bool]:
    """The targets in a batch, counted before the forward, and whether they are a Hugging Face batch's `labels`
    (which the model shifts: the first label of each row is never a target). None when the batch holds none the
    launcher knows: `labels`, `targets`, or a tuple's last integer tensor."""
    if isinstance(batch, Mapping):
        if "labels" in batch:
            labels = batch["labels"]
            return int((labels[..., 1:] != IGNORE_INDEX).sum()), True
        targets = batch.get("targets")
    elif isinstance(batch, (list, tuple)) and batch:
        targets = batch[-1]
    else:
        targets = None
    if isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dtype != torch.bool:
        return int((targets != IGNORE_INDEX).sum()), False
    return None, False


@dataclass(frozen=True)
class StepTargets:
    """This rank's micro-batches' target counts and the global batch's total, made before the step's first forward."""

    counts: list[int | None]
    labels: list[bool]
    """Per micro-batch: whether the counts are of a Hugging Face batch's labels."""
    total: float
    """Targets in the whole global batch, all ranks (0 when some micro-batch, on any rank, could not be counted)."""
    world_size: int

    @property
    def counted(self) -> bool:
        return self.total > 0


def count_targets(batches: list[Any], world_size: int, all_reduce: Any) -> StepTargets:
    """Count this rank's micro-batches' targets, and the global batch's with one all-reduce (sum of the counts,
    and of the micro-batches that could not be counted: any such makes the whole step uncounted)."""
    found = [target_tokens(b) for b in batches]
    counts = [c for c, _ in found]
    total, uncounted = all_reduce([float(sum(c or 0 for c in counts)), float(sum(c is None for c in counts))])
    return StepTargets(counts, [hf for _, hf in found], total if uncounted == 0 else 0.0, world_size)


def micro_loss(
    output: Any, k: int, targets: StepTargets, accumulation: int, divided: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(what micro-step k backpropagates, its part of the logged loss, whether it is token-normalised).

    Token-normalised (see the module), when the targets were counted and the model returns a sum or is a Hugging
    Face model with `labels`: the backward value is the summed loss times G / N and the part is the summed loss
    (the logged loss is then Σ parts over ranks / N). `divided`: the model was handed `num_items_in_batch=N/G`
    and returned the summed loss divided by it already. Otherwise the usual mean / K (logged: Σ parts / G).
    """
    loss, tokens = model_loss(output)
    count, labels = targets.counts[k], targets.labels[k]
    if tokens is not None:  # the model summed: it must have counted what the launcher counted
        if count is None:
            raise ValueError(
                "the model returns a summed loss, but the launcher cannot count this batch's targets before the "
                "forward (it counts `labels`, `targets`, or a tuple's last integer tensor, -100 ignored); return a "
                "mean, or give the batch its targets there"
            )
        if int(tokens) != count:
            raise ValueError(
                f"the model counted {int(tokens)} targets in micro-batch {k + 1}, the batch holds {count} "
                "(-100 ignored); count the targets the loss is over, or return a mean"
            )
    if not targets.counted or (tokens is None and not labels):
        if tokens is not None:
            loss = loss / tokens.clamp(min=1)  # a sum over a batch we could not count: its own mean, as usual
        return loss / accumulation, loss.detach() / accumulation, False
    scale = targets.world_size / targets.total
    if divided:
        return loss, loss.detach() / scale, True
    if tokens is None:  # a Hugging Face mean over its own (shifted) labels: back to the sum
        if count == 0:
            raise ValueError(
                f"micro-batch {k + 1} holds no targets and the model returns a mean (0/0); return (loss_sum, "
                "num_tokens), accept num_items_in_batch, or use larger micro-batches"
            )
        loss = loss * count
    return loss * scale, loss.detach(), True
