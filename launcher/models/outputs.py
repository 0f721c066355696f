"""Where things are in a model's output and in a batch: a key, an attribute or a position, said by the config
(`trainer.loss`, a metric's `preds` and `target`) or found where only one thing can be meant.

A place is a key of a mapping (a dict, a transformers ModelOutput), an attribute of an object, or a position in a
tuple or list (0, 1, -1), and a dotted path goes deeper (`out.logits`, `0.logits`). Found, unless told:
- the loss: a scalar, `loss`, or a tuple's only scalar tensor (nanoGPT's and minGPT's `(logits, loss)`;
  `launcher.models.loss`);
- a metric's predictions: the output itself when it is a tensor, its `logits`, or a tuple's only tensor of more
  than one dimension;
- a metric's target: the batch's `labels`, `targets` or `label`, or a tuple's last tensor (what the loss counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def pick(obj: Any, where: Any, what: str, setting: str) -> Any:
    """The value at `where` (a key, an attribute, a position, or a dotted path of them) in `obj`; one line naming
    `setting` and what is there where it is not found."""
    here = obj
    for part in str(where).split(".") if not isinstance(where, int) else [where]:
        found, here = _step(here, part)
        if not found:
            raise KeyError(f"{setting}={where}: {what} has no {part!r} ({describe(obj)}); {places(obj)}")
    return here


def _step(obj: Any, part: Any) -> tuple[bool, Any]:
    if isinstance(obj, (tuple, list)):
        try:
            return True, obj[int(part)]
        except (ValueError, IndexError):
            return False, None
    if isinstance(obj, Mapping):
        return (True, obj[part]) if part in obj else (False, None)
    return (True, getattr(obj, str(part))) if hasattr(obj, str(part)) else (False, None)


def places(obj: Any) -> str:
    """The places a setting may name in `obj`, for an error."""
    if isinstance(obj, (tuple, list)):
        return f"a position from 0 to {len(obj) - 1}"
    if isinstance(obj, Mapping):
        return f"one of its keys: {', '.join(map(str, obj))}"
    return "an attribute of it"


def describe(value: Any) -> str:
    """A value in a few words: `a tensor of shape [4, 3]`, `a tuple of (a tensor of shape [4, 3], a scalar tensor)`."""
    if isinstance(value, torch.Tensor):
        return "a scalar tensor" if value.dim() == 0 else f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(describe(v) for v in value)})"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, value))}"
    return "None" if value is None else f"a {type(value).__name__}"


def only_scalar(output: Any) -> int | None:
    """The position of a tuple's (or list's) only scalar floating tensor, the loss of `(logits, loss)`; None where
    there is none or more than one."""
    if not isinstance(output, (tuple, list)):
        return None
    found = [i for i, v in enumerate(output) if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
    return found[0] if len(found) == 1 else None


def find_preds(output: Any) -> tuple[Any, str] | None:
    """A metric's predictions found in a model's output, and where they were found (for the line said at start);
    None where more than one thing could be meant."""
    if isinstance(output, torch.Tensor) and output.dim() > 0:
        return output, "the output"
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"], "logits"
    if not isinstance(output, (tuple, list, Mapping)) and isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits, "logits"
    if isinstance(output, (tuple, list)):
        found = [i for i, v in enumerate(output) if isinstance(v, torch.Tensor) and v.dim() > 0]
        if len(found) == 1:
            return output[found[0]], str(found[0])
    return None


def find_target(batch: Any) -> tuple[Any, str] | None:
    """A metric's target found in a batch (its labels, as the loss counts them), and where; None where there is
    none."""
    if isinstance(batch, Mapping):
        for key in ("labels", "targets", "label"):
            if key in batch:
                return batch[key], key
        return None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor):
        return batch[-1], str(len(batch) - 1)
    return None
