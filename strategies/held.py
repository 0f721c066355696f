"""Tensors a model holds that are neither parameters nor buffers: a diffusers scheduler's `alphas_cumprod`, a lookup
table, a cached mask, kept as a plain attribute of a module or of an object a module holds.

A strategy that builds the model on the meta device (FSDP) materialises and fills its parameters and buffers only;
such a tensor would stay meta ("Cannot copy out of meta tensor"). `held_tensors` finds them (the same walk, in the
same order, on every rank), `check_held` refuses in the launcher what cannot be filled, and `fill_held` gives every
rank rank 0's values, on the device rank 0's constructor put them: what one process would hold.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

INTERNAL = frozenset(vars(nn.Module()))
"""A module's own bookkeeping (its parameters, buffers, children, hooks): not what its constructor made."""
MAX_DEPTH = 6
"""Objects within objects followed from a module's attribute: deep enough for a scheduler's config, never a cycle."""
SKIPPED = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    torch.dtype,
    torch.device,
)
"""Values that hold no tensor of the model's."""

Step = tuple[str, Any]
"""One step from a holder to what it holds: ("module", path), ("attr", name), ("key", key), ("index", i), or
("member", None) for a set's member (which cannot be replaced)."""


@dataclass(frozen=True)
class Held:
    steps: tuple[Step, ...]
    """From the root model: its submodule, then attributes, keys and indices."""
    tensor: torch.Tensor

    @property
    def path(self) -> str:
        """`model.scheduler.alphas_cumprod`, `model.tables[2]`, `model.cache['mask']`."""
        out = "model"
        for kind, key in self.steps:
            if kind == "module":
                out += f".{key}" if key else ""
            elif kind == "attr":
                out += f".{key}"
            elif kind == "member":
                out += ".<a set's member>"
            else:
                out += f"[{key!r}]"
        return out


def held_tensors(model: nn.Module) -> list[Held]:
    """Every tensor the model holds outside its parameters and buffers, under every path it is held at, in a fixed
    order (the same on every rank for the same model)."""
    registered = {id(t) for t in (*model.parameters(), *model.buffers())}
    modules = {id(m) for m in model.modules()}
    found: list[Held] = []
    seen: set[int] = set()

    def visit(obj: Any, steps: tuple[Step, ...], depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in registered:
                found.append(Held(steps, obj))
            return
        if isinstance(obj, SKIPPED) or id(obj) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            if id(obj) not in modules:  # a module kept outside the tree (in a plain list): everything it holds
                for key, value in vars(obj).items():
                    visit(value, (*steps, ("attr", key)), depth + 1)
        elif isinstance(obj, dict):
            for key, value in list(obj.items()):
                visit(value, (*steps, ("key", key)), depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, (*steps, ("index", i)), depth + 1)
        elif isinstance(obj, (set, frozenset)):
            for value in obj:
                visit(value, (*steps, ("member", None)), depth + 1)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            for key, value in list(vars(obj).items()):
                visit(value, (*steps, ("attr", key)), depth + 1)

    for name, module in model.named_modules():
        seen.add(id(module))
        for key, value in list(vars(module).items()):
            if key not in INTERNAL:
                visit(value, (("module", name), ("attr", key)), 1)
    return found


def check_held(model: nn.Module, strategy: str) -> None:
    """ValueError (one line) for a tensor the model holds that `fill_held` could not make right under a strategy
    that builds the model on the meta device: one held in a set (it cannot be replaced), or a view of a parameter or
    buffer (which the strategy re-creates: the view would no longer follow it)."""
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    for held in held_tensors(model):
        base = held.tensor._base
        if base is not None and id(base) in names:
            raise ValueError(
                f"{held.path} is a view of {names[id(base)]}, which {strategy} re-creates on each rank (sharded): "
                "the view would no longer follow it; compute it in forward, or use strategy=ddp or a ZeRO preset"
            )
        if any(kind == "member" for kind, _ in held.steps):
            raise ValueError(
                f"{held.path} is a tensor in a set, which {strategy} cannot fill with rank 0's values (it builds the "
                "model on the meta device); keep it in a list, a dict or an attribute, or register it as a buffer"
            )


def fill_held(held: list[Held], model: nn.Module, whole: nn.Module | None, device: str) -> None:
    """Every rank's held tensors (`held_tensors` of its meta-device build, before anything wrapped it) made rank 0's
    (`whole`, its model built for real; None on the other ranks), on the device rank 0's constructor put each
    (collective: one broadcast per tensor over `device`). A tensor held under several paths stays one tensor."""
    import torch.distributed as dist

    if not held:  # the same walk on every rank: none has any, and no collective is skipped by one rank alone
        return
    distinct = list({id(h.tensor): h for h in held}.values())
    sources = [_source(whole, h) for h in distinct] if whole is not None else []
    specs: list[Any] = [[(t.device.type, t.requires_grad) for t in sources]]
    dist.broadcast_object_list(specs, src=0)
    filled: dict[int, torch.Tensor] = {}
    for i, (h, (kind, grad)) in enumerate(zip(distinct, specs[0])):
        where = device if kind == torch.device(device).type else kind  # rank 0's accelerator: this rank's own
        buffer = (
            sources[i].detach().to(device, copy=True)
            if whole is not None
            else torch.empty(h.tensor.shape, dtype=h.tensor.dtype, device=device)
        )
        dist.broadcast(buffer, src=0)
        if h.tensor.is_meta:
            filled[id(h.tensor)] = buffer.to(where).requires_grad_(grad)
        else:  # real already (a constructor's numpy-made tensor): rank 0's values, in place, aliases kept
            with torch.no_grad():
                h.tensor.copy_(buffer)
    for h in held:
        if id(h.tensor) in filled:
            _replace(model, h.steps, filled[id(h.tensor)])


def _source(whole: nn.Module, held: Held) -> torch.Tensor:
    """Rank 0's tensor at the path of `held`, checked against it."""
    found = _resolve(whole, held.steps)
    if not isinstance(found, torch.Tensor) or found.shape != held.tensor.shape or found.dtype != held.tensor.dtype:
        raise RuntimeError(
            f"{held.path} is a {held.tensor.dtype} tensor of shape {tuple(held.tensor.shape)} in the model built on "
            f"the meta device but {type(found).__name__} {getattr(found, 'dtype', '')} "
            f"{tuple(getattr(found, 'shape', ()))} in rank 0's: its constructor made it differently; build it the "
            "same way on any device, or use strategy=ddp or a ZeRO preset"
        )
    return found


def _resolve(root: nn.Module, steps: tuple[Step, ...]) -> Any:
    obj: Any = root
    for kind, key in steps:
        if kind == "module":
            obj = obj.get_submodule(key)
        elif kind == "attr":
            obj = vars(obj)[key]
        else:
            obj = obj[key]
    return obj


def _replace(root: nn.Module, steps: tuple[Step, ...], value: Any) -> None:
    """Put `value` where `steps` lead, past the holder's own `__setattr__`/`__setitem__` (a frozen dataclass, a
    diffusers FrozenDict); a tuple is rebuilt and replaced in its own holder."""
    holder = _resolve(root, steps[:-1])
    kind, key = steps[-1]
    if kind == "attr":
        vars(holder)[key] = value
    elif kind == "key":
        dict.__setitem__(holder, key, value)
    elif isinstance(holder, list):
        list.__setitem__(holder, key, value)
    else:  # a tuple (a namedtuple keeps its class)
        items = [value if i == key else item for i, item in enumerate(holder)]
        _replace(root, steps[:-1], type(holder)(*items) if hasattr(holder, "_fields") else type(holder)(items))
