"""A model's units: the modules a strategy wraps, shards, checkpoints or compiles one by one (its blocks), found by
class name or declared by the model, the weights tied across them, and compiling them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


def unit_classes(model: nn.Module, explicit: list[str] | None) -> list[str]:
    """Class names of a model's layer-sized units (what FSDP shards one by one, what compile compiles): the explicit
    list when given; else the model's own `_no_split_modules` that occur in it (transformers models declare them, as
    Accelerate reads them; so does the built-in GPT), less those whose units would split a tied parameter
    (`untied_units`); else none: the whole model is one unit."""
    if explicit is not None:
        return list(explicit)
    return untied_units(model, _declared_units(model))[0]


def _declared_units(model: nn.Module) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    return sorted(name for name in getattr(model, "_no_split_modules", None) or () if name in present)


def unit_modules(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Submodules (not the root) whose class name is listed, in pre-order (parents before children)."""
    return [m for m in model.modules() if m is not model and type(m).__name__ in class_names]


@dataclass(frozen=True)
class SplitTie:
    """One parameter reachable under several names (tied weights) whose names fall in different units."""

    names: tuple[str, ...]
    units: tuple[str, ...]
    """Per name, the class of the innermost unit holding it; "" for the root."""

    def describe(self) -> str:
        where = [f"{name} (in {unit or 'the root'})" for name, unit in zip(self.names, self.units)]
        return " = ".join(where)


def split_ties(model: nn.Module, class_names: list[str]) -> list[SplitTie]:
    """Tied parameters (the same Parameter under two module paths) that units of these classes would hold apart:
    FSDP gathers and shards a parameter with the one unit that claims it, so its other users, in another unit or
    the root, would meet it sharded."""
    units = {
        path: type(m).__name__
        for path, m in model.named_modules(remove_duplicate=False)
        if path and type(m).__name__ in class_names
    }
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = []
    for tied in (n for n in names.values() if len(n) > 1):
        holders = [max((u for u in units if name.startswith(u + ".")), key=len, default="") for name in tied]
        if len(set(holders)) > 1:
            found.append(SplitTie(tuple(tied), tuple(units.get(h, "") for h in holders)))
    return found


def untied_units(model: nn.Module, classes: list[str]) -> tuple[list[str], list[tuple[str, SplitTie]]]:
    """The unit classes less those whose units would split a tied parameter, and each class left out with its tie.

    A class whose units hold a parameter that is also reachable outside them (BERT's word embedding, tied to its
    decoder in the root; one weight shared by two blocks) is left out, and its modules go with the unit around
    them (at last the root); until no tie is split."""
    left_out: list[tuple[str, SplitTie]] = []
    while ties := split_ties(model, classes):
        for cls in sorted({unit for tie in ties for unit in tie.units if unit}):
            left_out.append((cls, next(t for t in ties if cls in t.units)))
        classes = [c for c in classes if c not in {cls for cls, _ in left_out}]
    return classes, left_out


def tied_unit_lines(model: nn.Module, explicit: list[str] | None) -> list[str]:
    """For a sharding strategy's check: one line for each of the model's own unit classes that `unit_classes` leaves
    out for a tie; explicit classes (`strategy.shard_units`) that split a tie are a ValueError naming the tied
    names and the classes that would do."""
    if explicit is None:
        return [
            f"{cls} is not a unit, though {type(model).__name__}._no_split_modules lists it: its parameter is tied, "
            f"{tie.describe()}, and a unit must hold every use of its parameters; its modules go with the unit "
            "around them"
            for cls, tie in untied_units(model, _declared_units(model))[1]
        ]
    kept, left_out = untied_units(model, list(explicit))
    if left_out:
        ties = "; ".join(t.describe() for t in split_ties(model, list(explicit)))
        raise ValueError(
            f"strategy.shard_units=[{','.join(explicit)}] splits tied parameters between units: {ties}; use "
            f"strategy.shard_units=[{','.join(kept)}] (units that keep each tied parameter together)"
        )
    return []


def compile_units(units: list[nn.Module]) -> None:
    """torch.compile each unit in place (`nn.Module.compile`): its class, names and state-dict keys stay the same.

    Per unit rather than the whole model: the graphs stay small and alike (one compile serves every block),
    and a sharding strategy can still put its hooks around each unit.
    """
    for unit in units:
        unit.compile()
