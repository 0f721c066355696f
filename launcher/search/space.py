"""The search space, written in Hydra's override grammar, as Optuna's distributions; and a trial's values back as
overrides of a run.

    optim.lr=tag(log,interval(1e-4,1e-2))    FloatDistribution(1e-4, 1e-2, log=True)
    trainer.warmup_steps=tag(int,interval(0,40))    IntDistribution(0, 40) (Hydra's interval alone gives floats)
    trainer.warmup_steps=range(0,40,10)      IntDistribution(0, 30, step=10): the values Hydra's range gives
    optim.weight_decay=choice(0.0,0.1), or 0.0,0.1     CategoricalDistribution((0.0, 0.1))

Anything else in the overrides is fixed: the same in every trial. A key given again wins, as in Hydra: a command line
`optim.lr=1e-3` fixes what `+sweep=search` would search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WATCHED = ("logger", "hydra", "trainer.progress", "rdzv", "plan")
"""Overrides a study may be continued with other values of: how its runs log, report and meet, not what they compute."""


class SpaceError(ValueError):
    """An override the search cannot sample: one line naming it and what to write instead."""


@dataclass(frozen=True)
class Space:
    distributions: dict[str, Any]
    """Parameter name (the override's key, `+` kept) -> Optuna distribution, in the order given."""
    fixed: list[str]
    """The overrides every trial gets as they are."""

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """One trial's overrides: the fixed ones, then each sampled value (the later wins in Hydra)."""
        return [*self.fixed, *(f"{name}={_as_override(params[name])}" for name in self.distributions)]

    def definition(self) -> list[str]:
        """What makes two runs of a sweep the same study: every distribution and every fixed override but those that
        only say how a run is watched (`WATCHED`)."""
        import json

        from optuna.distributions import distribution_to_json

        spelled = {n: json.loads(distribution_to_json(d)) for n, d in self.distributions.items()}
        fixed = [o for o in self.fixed if not o.lstrip("+~").startswith(WATCHED)]
        return [f"{n}: {json.dumps(d, sort_keys=True)}" for n, d in spelled.items()] + sorted(fixed)


def parse(overrides: Sequence[str]) -> Space:
    """Split overrides (Hydra's grammar) into the search space and the fixed rest; SpaceError for a sweep that has
    no distribution (a glob)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    distributions: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.get_key_element()
        distributions.pop(key, None), fixed.pop(key, None)  # a later override of a key wins, as in Hydra
        if o.is_sweep_override():
            distributions[key] = distribution(key, o.value())
        else:
            fixed[key] = f"{key}={o.get_value_element_as_str()}"
    return Space(distributions, list(fixed.values()))


def distribution(key: str, sweep: Any) -> Any:
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    tags = set(getattr(sweep, "tags", ()) or ())
    log = "log" in tags
    if isinstance(sweep, ChoiceSweep):
        return CategoricalDistribution([_plain(v) for v in sweep.list])
    if isinstance(sweep, RangeSweep):
        values = list(_range(sweep.start, sweep.stop, sweep.step))
        if not values:
            raise SpaceError(f"{key}=range({sweep.start},{sweep.stop},{sweep.step}) holds no value; widen it")
        if all(isinstance(v, int) for v in (sweep.start, sweep.stop, sweep.step)):
            return IntDistribution(values[0], values[-1], step=sweep.step, log=log)
        return FloatDistribution(values[0], values[-1], step=sweep.step, log=log)
    if isinstance(sweep, IntervalSweep):
        low, high = sweep.start, sweep.end
        if not low < high:
            raise SpaceError(f"{key}=interval({low},{high}) is empty; write interval(LOW,HIGH) with LOW < HIGH")
        if log and low <= 0:
            raise SpaceError(f"{key}=tag(log,interval({low},{high})) needs LOW > 0 on a log scale; raise LOW")
        if "int" in tags:
            return IntDistribution(int(low), int(high), log=log)
        return FloatDistribution(float(low), float(high), log=log)
    raise SpaceError(
        f"{key}: a search cannot sample {type(sweep).__name__.lower()}(...); use choice(...), range(...) or "
        f"interval(...), e.g. {key}=tag(log,interval(1e-4,1e-2))"
    )


def _range(start: float, stop: float, step: float) -> Any:
    """Hydra's range: start, start + step, ... before stop."""
    n = 0
    while (value := start + n * step) < stop if step > 0 else value > stop:
        yield value
        n += 1


def _plain(value: Any) -> Any:
    """A choice as Optuna stores it: None, bool, int, float or str."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _as_override(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def low_end(distributions: dict[str, Any]) -> dict[str, Any]:
    """A point of the space: each distribution's lowest value, or first choice."""
    return {n: d.choices[0] if hasattr(d, "choices") else d.low for n, d in distributions.items()}
