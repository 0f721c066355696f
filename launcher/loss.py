"""The model contract of the runner: what a forward returns, and the loss the runner optimises and logs.

A forward may return the scalar loss itself, or anything that carries one: a transformers ModelOutput (its
`.loss`), a dict with "loss". Everything else is a one-line error naming what came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def model_loss(output: Any) -> torch.Tensor:
    """The scalar loss in a forward's output."""
    loss = output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise TypeError(
        f"the model's forward returned {_describe(output)}; return the scalar loss, or an object with a scalar "
        "`loss` (a transformers ModelOutput, a dict with 'loss'); a transformers model needs `labels` in the batch"
    )


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {sorted(map(str, output))} but no scalar 'loss'"
    return f"a {type(output).__name__}"


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of its token ids (`input_ids`, or the first tensor) when they are integers;
    0 for batches of other data (images, features), which have no tokens to count."""
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)):
        first = batch[0] if batch else None
    else:
        first = batch
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and not first.is_complex():
        return int(first.numel())
    return 0
