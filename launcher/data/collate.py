"""A micro-batch from a rank's own samples, and moving it to the device.

`data.collate` names the collate: a function called with the list of samples (its own keys bound:
`+data.collate.KEY=VALUE`), or a class Hydra builds with its keys, whose instance is called with the list
(`transformers.DataCollatorWithPadding` over a tokenizer, PyG's `Collater`, one of your own). Unset, the launcher's
default: torch's `default_collate` over samples whose fields are numbers, tensors, arrays or (nested) lists of numbers,
the lists made tensors first. A `datasets` row holds Python lists: `default_collate` alone would turn a list of 128
ids into 128 tensors of one position each, and the model would be blamed for it; a field of anything else (a string)
is refused, naming it.

A batch may be any nesting of tensors (dicts and other mappings, lists, tuples, named tuples) and of objects that move
themselves with `.to(device)` (a PyG `Batch`, a transformers `BatchEncoding`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

Collate = Callable[[list[Any]], Any]


class DataError(ValueError):
    """A sample or a batch the run cannot use: one line naming it and the fix."""


def build_collate(node: Any) -> Collate:
    """The collate a `data.collate` node names (a class built with its keys, or a function with its keys bound), or
    the launcher's default when the node is unset."""
    if node is None or node.get("_target_") is None:
        return default_collate
    import inspect

    from hydra.utils import instantiate

    from launcher.base.targets import locate

    target = locate(str(node._target_))
    built = instantiate(node, _partial_=not inspect.isclass(target), _convert_="all")
    if not callable(built):
        raise TypeError(f"data.collate._target_={node._target_} built a {type(built).__name__}, which is not callable")
    return built


def collate_name(node: Any) -> str:
    """How lines name a collate: its target, or the launcher's default."""
    if node is None or node.get("_target_") is None:
        return "the default collate (torch's default_collate)"
    return f"data.collate._target_={node._target_}"


def default_collate(samples: list[Any]) -> Any:
    """torch's `default_collate` over the samples with their lists of numbers made tensors (`as_tensors`); DataError
    (one line) for a field that is none of numbers, tensors and lists of numbers, or fields of a micro-batch whose
    shapes differ (they need padding: a collate of one's own)."""
    from torch.utils.data import default_collate as stack

    rows = [as_tensors(s) for s in samples]
    try:
        return stack(rows)
    except RuntimeError as e:  # torch.stack of unequal shapes
        raise DataError(_ragged(rows) or f"the samples do not stack ({' '.join(str(e).split())})") from e


def as_tensors(sample: Any) -> Any:
    """A sample with every field that is a (nested) list of numbers as a tensor: the fields of a mapping, of a tuple
    (torch's convention: `(inputs, label)`), of a list of non-numbers; a sample that is a list of numbers is one
    tensor (a sequence of ids). DataError for a field the default collate cannot batch."""
    if isinstance(sample, Mapping):
        return {k: _field(v, repr(str(k))) for k, v in sample.items()}
    if isinstance(sample, tuple) or (isinstance(sample, list) and not _numeric(sample)):  # fields, as torch's
        fields = [_field(v, f"{i} (of a {type(sample).__name__} sample)") for i, v in enumerate(sample)]
        return type(sample)(*fields) if hasattr(sample, "_fields") else type(sample)(fields)
    return _field(sample, "the sample itself")


def _numeric(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and all(isinstance(v, numbers.Number) or _numeric(v) for v in value)
    )


def _field(value: Any, name: str) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) or (
        isinstance(value, numbers.Number) and not isinstance(value, complex)
    ):
        return value
    if isinstance(value, (list, tuple)) and _numeric(value):
        try:
            return torch.as_tensor(value)
        except (ValueError, TypeError) as e:  # lists of different lengths inside one field
            raise DataError(
                f"field {name} holds nested lists of different lengths ({' '.join(str(e).split())}); the default "
                "collate stacks rectangular lists only: pad them, or give a collate (data.collate._target_=...)"
            ) from e
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise DataError(
        f"field {name} is a {type(value).__name__} ({shown}), neither a number, a list of numbers nor a tensor: the "
        "default collate cannot batch it; drop it (a datasets.Dataset: .remove_columns([...]) or .select_columns), or "
        "give a collate that turns it into tensors (data.collate._target_=...)"
    )


def _ragged(rows: list[Any]) -> str | None:
    """The field whose shapes differ between the samples of one micro-batch, said with its lengths, or None."""
    if not rows:
        return None
    first = rows[0]
    keys = (
        list(first) if isinstance(first, Mapping) else range(len(first)) if isinstance(first, (list, tuple)) else [None]
    )
    for key in keys:
        values = [r if key is None else r[key] for r in rows]
        shapes = {tuple(v.shape) for v in values if isinstance(v, (torch.Tensor, np.ndarray))}
        if len(shapes) > 1:
            lengths = sorted({s[0] if s else 0 for s in shapes})
            name = "the samples" if key is None else f"field {key!r}" if isinstance(key, str) else f"field {key}"
            return (
                f"{name} of one micro-batch have lengths {lengths[0]} to {lengths[-1]}: the default collate stacks "
                "equal shapes only; pad them with a collate, e.g. data.collate._target_=transformers."
                "DataCollatorWithPadding +data.collate.tokenizer._target_=transformers.AutoTokenizer.from_pretrained "
                "+data.collate.tokenizer.pretrained_model_name_or_path=TOKENIZER, or one of your own"
            )
    return None


def tensors_in(batch: Any) -> int:
    """How many tensors (or objects that move themselves to a device) a batch holds, at any depth."""
    if isinstance(batch, torch.Tensor):
        return 1
    if isinstance(batch, Mapping):
        return sum(tensors_in(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensors_in(v) for v in batch)
    return int(callable(getattr(batch, "to", None)) and not isinstance(batch, (str, bytes, type)))


def describe(value: Any) -> str:
    """A short account of a sample or a batch, for one line: its type and, for a mapping, its keys."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, list(value)[:8]))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__name__}"
