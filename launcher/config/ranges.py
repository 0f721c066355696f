"""What the schema declares beside each field, once: the valid values of a numeric field (`ranged`, checked by
`check_ranges`), and whether a field is part of the run's identity (`identity=False`: how a run is launched or
watched, not what it computes; read by `untracked`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field, declared once beside it (`ranged`) and checked by `check_ranges`."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    """Whether `low` itself is excluded."""
    open_high: bool = False
    rule: str = ""
    """How the rule reads in an error: "a positive integer", "a fraction in [0, 1)"."""
    words: tuple[str, ...] = ()
    """Strings the field also takes (`batch.micro_size=auto`), for a field typed Any."""
    pattern: str | None = None
    """A regular expression a string value may match instead (`nodes=MIN:MAX`)."""
    integer: bool = False
    """Whole numbers only: for a field typed Any, which OmegaConf does not convert to int."""

    def holds(self, value: Any) -> bool:
        import re

        if isinstance(value, str):
            return value in self.words or bool(self.pattern and re.fullmatch(self.pattern, value))
        if not isinstance(value, int | float) or (self.integer and not float(value).is_integer()):
            return False
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below


SIZE = Range(low=1, rule="a positive integer")
COUNT = Range(low=0, rule=">= 0")
POSITIVE = Range(low=0, open_low=True, rule="> 0")
FRACTION = Range(low=0, high=1, open_high=True, rule="a fraction in [0, 1)")
UNIT = Range(low=0, high=1, rule="in [0, 1]")
OPEN_UNIT = Range(low=0, high=1, open_low=True, open_high=True, rule="in (0, 1), e.g. 0.999")
PORT = Range(low=1, high=65535, rule="a port in [1, 65535]")
ZERO_STAGE = Range(low=1, high=3, rule="a ZeRO stage: 1, 2 or 3")
MICRO = Range(low=1, rule="a positive integer, or auto", words=("auto",), integer=True)
EVAL_BATCHES = Range(low=1, rule="a positive integer, or all (every sample of each set)", words=("all",), integer=True)
NODES = Range(low=1, rule="a positive integer, or MIN:MAX (an elastic job)", pattern=r"\d+:\d+", integer=True)


def ranged(default: Any, valid: Range, identity: bool = True, doc: str = "") -> Any:
    """A field with its valid range; None (an unset optional) is always valid. `identity=False`: see `launch_only`.
    `doc`: the meaning of a field that several schemas declare alike, written once (else its docstring says it)."""
    return field(default=default, metadata={"range": valid, "identity": identity, "doc": doc})


def launch_only(default: Any = None, factory: Any = None, valid: Range | None = None, doc: str = "") -> Any:
    """A field that changes how a run is launched, watched or kept (its length, logs, checkpoints, timeouts, world
    size), not what it computes from step to step: not part of its identity (`untracked`), so the same run resumes
    with another value. Every other field counts."""
    metadata = {"range": valid, "identity": False, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _fields(cfg: Any, path: str = "") -> Any:
    """(dotted key, the schema's field or None, value) of every set value of a composed config, depth first: each
    node's schema (its dataclass) read from the config itself."""
    import dataclasses

    from omegaconf import DictConfig

    schema = OmegaConf.get_type(cfg)
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in cfg:
        name = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_missing(cfg, key):
            continue  # a missing value has its own error
        try:
            value = cfg[key]
        except Exception:  # an interpolation that does not resolve: freeze() names it
            continue
        yield name, fields.get(str(key)), value
        if isinstance(value, DictConfig):
            yield from _fields(value, name)


def untracked(cfg: Any) -> set[str]:
    """The dotted keys of a composed config that are not part of the run's identity (`launch_only` fields), outermost
    only: a node left out is left out whole."""
    left_out: set[str] = set()
    for name, spec, _ in _fields(cfg):
        inside = any(name.startswith(f"{outer}.") for outer in left_out)
        if spec is not None and not spec.metadata.get("identity", True) and not inside:
            left_out.add(name)
    return left_out


def check_ranges(cfg: Any) -> str | None:
    """The first value of a composed config outside its field's range, as a one-line error; None if all are in.

    Reads each node's schema (its dataclass) from the composed config itself: every `ranged` field of every
    schema is checked, with no list of fields kept anywhere else.
    """
    for name, spec, value in _fields(cfg):
        valid = spec.metadata.get("range") if spec is not None else None
        if valid is not None and value is not None and not isinstance(value, bool) and not valid.holds(value):
            return f"{name}={value} is invalid: it must be {valid.rule}"
    return None
