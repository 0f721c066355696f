"""The valid values of the schema's numeric fields, declared once beside each field and checked by one function."""

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

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below


SIZE = Range(low=1, rule="a positive integer")
COUNT = Range(low=0, rule=">= 0")
POSITIVE = Range(low=0, open_low=True, rule="> 0")
FRACTION = Range(low=0, high=1, open_high=True, rule="a fraction in [0, 1)")
UNIT = Range(low=0, high=1, rule="in [0, 1]")
PORT = Range(low=1, high=65535, rule="a port in [1, 65535]")
ZERO_STAGE = Range(low=1, high=3, rule="a ZeRO stage: 1, 2 or 3")


def ranged(default: Any, valid: Range) -> Any:
    """A field with its valid range; None (an unset optional) is always valid."""
    return field(default=default, metadata={"range": valid})


def check_ranges(cfg: Any, path: str = "") -> str | None:
    """The first value of a composed config outside its field's range, as a one-line error; None if all are in.

    Reads each node's schema (its dataclass) from the composed config itself: every `ranged` field of every
    schema is checked, with no list of fields kept anywhere else.
    """
    import dataclasses

    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        return None
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
        valid = fields[key].metadata.get("range") if key in fields else None
        if valid is not None and value is not None and not isinstance(value, bool) and not valid.holds(value):
            return f"{name}={value} is invalid: it must be {valid.rule}"
        problem = check_ranges(value, name) if isinstance(value, DictConfig) else None
        if problem:
            return problem
    return None
