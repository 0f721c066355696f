"""The model contract of the runner, and the loss of an optimizer step.

A forward may return:
- the summed loss and its token count: `(loss_sum, num_tokens)`, or a dict or object with `loss_sum` and
  `num_tokens` (the built-in GPT returns a dict with both and the mean as `loss`);
- a mean: a scalar tensor, or anything with a scalar `loss` (a transformers ModelOutput, a dict with "loss").

**The loss of a step** is Σ(token losses) / Σ(target tokens) over every micro-step and rank, and its gradient is
the gradient of one forward over the whole global batch, whenever the launcher knows the targets the loss is over:
a model that returns a sum and its count, or a transformers model with `labels` in its batch, whose labels are
counted as the model counts them (`LabelRule`, decided once in the parent: `launcher.models.meta.label_rule`) — shifted
for a causal LM (the first label of each row is no target), as they stand for a masked LM or a seq2seq model; -100
counts for nothing. The runner counts the global batch's targets N before the first forward (one all-reduce), then
backpropagates each micro-step's summed loss times G / N: every strategy averages gradients over its G ranks, so
what they hold at the step is the gradient of (Σ sums) / N, whatever K and G — the same value under DDP, FSDP and
DeepSpeed alike. The summed loss is the model's own sum, or its sum divided by `num_items_in_batch` = N / G where the
model uses that argument (measured in the parent), or its mean times the micro-batch's count.

A model whose mean cannot be turned into a sum (the batch's targets cannot be counted, or the launcher does not
know which of them the mean is over: `targets`, a tuple's last integer tensor, `labels` of a model of one's own)
keeps the usual recipe, mean / K averaged over ranks — exact only when every micro-batch holds as many targets as
every other (equal-length samples) — and rank 0 says so once, in one line.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from launcher.models.outputs import describe, only_scalar, pick

IGNORE_INDEX = -100
"""Targets with this value count for nothing (torch's cross_entropy default, and transformers')."""
NUM_ITEMS = "num_items_in_batch"
"""The keyword with which a transformers model divides its summed loss itself (instead of by its own count)."""


@dataclass(frozen=True)
class LabelRule:
    """How a model counts the `labels` of its batch, decided once in the parent and frozen into `resolved.yaml`
    (`derived.model`): the workers read it, never derive it again."""

    takes_num_items: bool = False
    """Its forward divides its summed loss by `num_items_in_batch` when handed it (measured: its loss depends on it)."""
    label_shift: int | None = None
    """Leading labels of each row that are no target: 1 for a causal LM (it shifts them), 0 for a masked LM or a
    seq2seq model (each label is the target where it stands); None when the launcher does not know how the model
    counts them (a model of one's own): its `labels` are then counted as they stand, and its mean stays a mean."""

    loss_at: Any = None
    """Where the loss is in the model's output (trainer.loss: a key, an attribute or a position); None: found."""

    @classmethod
    def of(cls, derived_model: Mapping[str, Any] | None, loss_at: Any = None) -> LabelRule:
        model = derived_model or {}
        shift = model.get("label_shift")
        return cls(bool(model.get("takes_num_items", False)), None if shift is None else int(shift), loss_at)


def model_loss(output: Any, where: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, num_tokens): a summed loss and its count when the output has both, else (the mean, None). `where`
    (trainer.loss): the mean's place in the output, a key, an attribute or a position (`launcher.models.outputs`);
    unset: found (a scalar, `loss`, or a tuple's only scalar tensor: nanoGPT's `(logits, loss)`, said once)."""
    if where is not None:
        loss = pick(output, where, "the model's output", "trainer.loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss, None
        raise TypeError(f"trainer.loss={where} is {describe(loss)} in the model's output, not a scalar loss")
    summed = _summed(output)
    if summed is not None:
        return summed
    loss = output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss, None
    found = only_scalar(output)
    if found is not None:
        say_once_at_start(
            f"launch: loss: the model's forward returns a {type(output).__name__}; its loss is its only scalar "
            f"tensor, at position {found} (trainer.loss={found} says so)"
        )
        return output[found], None
    raise TypeError(
        f"the model's forward returned {_describe(output)}; return the scalar loss, an object with a scalar `loss` "
        "(a transformers ModelOutput, a dict with 'loss'), or (loss_sum, num_tokens), or set trainer.loss to where "
        "the loss is (a key, an attribute or a position); a transformers model needs `labels` in the batch"
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
    if isinstance(output, (tuple, list)):
        return describe(output)
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


def target_tokens(batch: Any, label_shift: int | None = None) -> tuple[int | None, bool]:
    """The targets in a batch, counted before the forward, and whether the model's mean is over exactly these: a
    Hugging Face batch's `labels` of a model whose rule is known (`label_shift` leading labels of each row are no
    target). None when the batch holds none the launcher knows; `labels` of a model whose rule it does not know,
    `targets`, or a tuple's last integer tensor count as they stand (-100 ignored)."""
    if isinstance(batch, Mapping):
        if "labels" in batch and label_shift is not None:
            labels = batch["labels"]
            return int((labels[..., label_shift:] != IGNORE_INDEX).sum()), True
        targets = batch.get("labels", batch.get("targets"))
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
    """Per micro-batch: whether the model's mean is over exactly the counted targets (its labels, by its rule)."""
    total: float
    """Targets in the whole global batch, all ranks (0 when some micro-batch, on any rank, could not be counted)."""
    world_size: int

    @property
    def counted(self) -> bool:
        return self.total > 0


def count_targets(batches: list[Any], world_size: int, all_reduce: Any, label_shift: int | None = None) -> StepTargets:
    """Count this rank's micro-batches' targets, and the global batch's with one all-reduce (sum of the counts,
    and of the micro-batches that could not be counted: any such makes the whole step uncounted)."""
    found = [target_tokens(b, label_shift) for b in batches]
    counts = [c for c, _ in found]
    total, uncounted = all_reduce([float(sum(c or 0 for c in counts)), float(sum(c is None for c in counts))])
    return StepTargets(counts, [hf for _, hf in found], total if uncounted == 0 else 0.0, world_size)


def micro_loss(
    output: Any, k: int, targets: StepTargets, accumulation: int, divided: bool = False, where: Any = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(what micro-step k backpropagates, its part of the logged loss, whether it is token-normalised).

    Token-normalised (see the module), when the targets were counted and the model returns a sum or its mean is
    over the counted targets (`StepTargets.labels`): the backward value is the summed loss times G / N and the
    part is the summed loss (the logged loss is then Σ parts over ranks / N). `divided`: the model was handed
    `num_items_in_batch=N/G` and returned the summed loss divided by it already. Otherwise the usual mean / K
    (logged: Σ parts / G). `where`: trainer.loss (`model_loss`).
    """
    loss, tokens = model_loss(output, where)
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
    if tokens is None:  # a mean over the counted targets: back to the sum
        if count == 0:
            raise ValueError(
                f"micro-batch {k + 1} holds no targets and the model returns a mean (0/0); return (loss_sum, "
                "num_tokens), accept num_items_in_batch, or use larger micro-batches"
            )
        loss = loss * count
    return loss * scale, loss.detach(), True


def usual_recipe_line(targets: StepTargets) -> str:
    """The one line that says a step's loss is the usual recipe's, and why."""
    why = (
        "the batch's targets cannot be counted before the forward (the launcher counts `labels`, `targets`, or a "
        "tuple's last integer tensor)"
        if not targets.counted
        else "the launcher does not know which of the batch's targets the mean is over (it knows a transformers "
        "model's `labels`)"
    )
    return (
        f"launch: loss: the model returns a mean and {why}: each micro-step's mean / K, averaged over ranks (the "
        "usual recipe), exact only when every micro-batch holds as many targets as every other; return "
        "(loss_sum, num_tokens) for the loss of the whole global batch"
    )


@functools.cache
def say_once(line: str) -> None:
    """Print a line the first time it is asked for in this process."""
    print(line, flush=True)


def say_once_at_start(line: str) -> None:
    """Say a line once: in the launcher (its checks before start; a sweep's, once for the sweep) and on rank 0
    (`RANK`, which torch's agent sets in each worker; a worker forked from the launcher remembers that the launcher
    said it)."""
    if os.environ.get("RANK", "0") == "0":
        say_once(line)
