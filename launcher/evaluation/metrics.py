"""Validation metrics of the user's choice (`trainer.metrics`), reduced over ranks exactly.

A metric is either
- a torchmetrics `Metric`, named by `_target_` with its own keys (`MulticlassAccuracy`, `Perplexity`, `BLEUScore`...):
  each rank updates its own with its micro-batches; at the pass's end each state is reduced over ranks by the
  reduction the metric declares for it (a sum: added, floating states kept in float64; a concatenation: every rank's
  items, in rank order; a maximum or minimum), and the metric is computed from the reduced states on every rank.
  torchmetrics' own sync is not used: it reduces float32 sums in another order than one process does, and a state
  averaged over ranks (`dist_reduce_fx="mean"`) is exact only where every rank holds as many samples, so a metric
  with such a state is refused;
- or a function of the user's, `fn(output, batch)`, returning `(sum, count)`, or a dict of them (one figure each,
  `<name>/<key>`): Σ sums / Σ counts over every batch of every rank.

The validation's samples are the same at any world size (`launcher.data.sources`: `evaluation`), and what is reduced
over ranks are sums or every rank's items, never a mean of the ranks' means: the figure is one process's, at any
world size and under any strategy. The keys `preds` and `target` are the launcher's: where a metric's inputs are in
the model's output and in the batch (`launcher.models.outputs`), or `inputs`, a function of yours that makes the
metric's `update` arguments of (output, batch) (token ids decoded into the strings BLEUScore takes); every other key is
the metric's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from launcher.base.errors import ConfigError
from launcher.models.loss import say_once_at_start
from launcher.models.outputs import describe, find_preds, find_target, pick

LAUNCHER_KEYS = ("preds", "target", "inputs")
"""Keys of a metric's node that are the launcher's, never passed to the metric."""


def build_metrics(specs: Mapping[str, Any]) -> dict[str, Any]:
    """Each configured metric, built (`TorchMetric` or `SumMetric`); one line naming the bad one where one does
    not import or build."""
    return {str(name): build_metric(str(name), node) for name, node in specs.items()}


def build_metric(name: str, node: Any) -> Any:
    from hydra.utils import get_object, instantiate
    from omegaconf import OmegaConf

    spec = dict(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node)
    where = {key: spec.pop(key, None) for key in LAUNCHER_KEYS}
    target, setting = spec.get("_target_"), f"trainer.metrics.{name}"
    if not target:
        raise ConfigError(
            f"{setting} has no _target_: name a torchmetrics Metric (torchmetrics.classification.MulticlassAccuracy) "
            "or a function of (output, batch) returning (sum, count)"
        )
    try:
        made = get_object(target)
    except Exception as e:
        raise ConfigError(
            f"{setting}._target_={target} does not import ({_cause(e)}); name an importable metric"
        ) from e
    if not isinstance(made, type):  # a function of the user's: its other keys are bound to it
        keys = {k: v for k, v in spec.items() if k != "_target_"}
        return SumMetric(name, functools.partial(made, **keys) if keys else made)
    try:
        metric = instantiate(spec)
    except Exception as e:
        raise ConfigError(f"{setting}: {target} does not build ({_cause(e)}); fix its keys") from e
    if not all(callable(getattr(metric, m, None)) for m in ("update", "compute", "reset")) or not hasattr(
        metric, "_reductions"
    ):
        raise ConfigError(
            f"{setting}._target_={target} is no torchmetrics Metric (update, compute, declared states) nor a "
            "function; name one of them"
        )
    inputs = where["inputs"]
    if inputs is not None:
        try:
            inputs = get_object(str(inputs))
        except Exception as e:
            raise ConfigError(
                f"{setting}.inputs={where['inputs']} does not import ({_cause(e)}); name a function"
            ) from e
    return TorchMetric(name, metric, where["preds"], where["target"], inputs)


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None:  # Hydra wraps the constructor's own error
        e = e.__cause__
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _reduction(fx: Any) -> str | None:
    """The name of a torchmetrics state's reduction over ranks that the launcher makes exactly, else None."""
    from torchmetrics.utilities import data

    known = {data.dim_zero_sum: "sum", data.dim_zero_cat: "cat", data.dim_zero_max: "max", data.dim_zero_min: "min"}
    return known.get(fx)


class TorchMetric:
    """A torchmetrics `Metric` fed from the model's output and the batch, its states reduced over ranks exactly."""

    def __init__(
        self, name: str, metric: Any, preds: Any = None, target: Any = None, inputs: Callable[..., Any] | None = None
    ) -> None:
        self.name, self.metric, self.preds, self.target, self.inputs = name, metric, preds, target, inputs
        for state, fx in metric._reductions.items():
            if _reduction(fx) is None:
                how = getattr(fx, "__name__", repr(fx))
                raise ConfigError(
                    f"trainer.metrics.{name}: {type(metric).__name__}'s state {state!r} is reduced over ranks by {how},"
                    " which is exact only where every rank holds as many samples; choose a metric whose states are "
                    "sums, concatenations, maxima or minima, or a function returning (sum, count)"
                )
        metric.sync_on_compute, metric._to_sync = False, False  # the launcher reduces the states itself (`reduce`)

    def to(self, device: torch.device) -> TorchMetric:
        """On the run's device, its floating states in float64 (sums added in any order give the same figure)."""
        self.metric = self.metric.to(device)
        self.metric.set_dtype(torch.float64)
        return self

    def update(self, output: Any, batch: Any) -> None:
        if self.inputs is not None:  # a function of the user's makes update's arguments
            self.metric.update(*self.inputs(output, batch))
            return
        preds = self._input(output, self.preds, find_preds, "the model's output", "preds")
        target = self._input(batch, self.target, find_target, "the batch", "target")
        self.metric.update(preds, target)

    def _input(self, obj: Any, where: Any, find: Callable[[Any], Any], what: str, key: str) -> Any:
        setting = f"trainer.metrics.{self.name}.{key}"
        if where is not None:
            return pick(obj, where, what, setting)
        found = find(obj)
        if found is None:
            raise ValueError(
                f"{setting}: which part of {what} ({describe(obj)}) is the metric's {key} is not clear; set {setting} "
                "to a key, an attribute or a position"
            )
        value, at = found
        place = "itself" if at == "the output" else f"position {at}" if at.lstrip("-").isdigit() else repr(at)
        say_once_at_start(f"launch: metric {self.name}: {key} = {what}: {place} ({setting}={at} says so)")
        return value

    def reduce(self, device: torch.device) -> dict[str, float]:
        """Every state reduced over ranks by its declaration, the metric computed from them (the same on every
        rank), and reset for the next pass."""
        metric = self.metric
        for state, fx in metric._reductions.items():
            setattr(metric, state, _over_ranks(getattr(metric, state), _reduction(fx), device))
        value = metric.compute()
        metric.reset()
        return figures(self.name, value)


def _over_ranks(value: Any, how: str | None, device: torch.device) -> Any:
    if how == "cat":  # every rank's items, in rank order (their numbers may differ)
        items = value if isinstance(value, list) else [value]
        mine = torch.cat([v.reshape(1) if v.dim() == 0 else v for v in items]).cpu() if items else None
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        parts = [r for r in rows if r is not None and r.numel()]
        return [torch.cat(parts).to(device)] if parts else []
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[str(how)]
    wide = value.to(torch.float64 if value.is_floating_point() else torch.int64)
    dist.all_reduce(wide, op=op)
    return wide.to(value.dtype)


def figures(name: str, value: Any) -> dict[str, float]:
    """A computed value as logged figures: a scalar under `name`, a dict's scalars under `name/<key>`."""
    if isinstance(value, Mapping):
        return {f"{name}/{k}": v for key, item in value.items() for k, v in figures(str(key), item).items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {name: float(value)}
    if isinstance(value, (int, float)):
        return {name: float(value)}
    raise ValueError(
        f"trainer.metrics.{name} computed {describe(value)}; a logged figure is one number (per-class values: set "
        "the metric's average, e.g. average=micro)"
    )


class SumMetric:
    """A function of the user's over (model output, batch) returning (sum, count), or a dict of them: Σ sums / Σ
    counts over every batch and rank, added in float64."""

    def __init__(self, name: str, fn: Callable[[Any, Any], Any]) -> None:
        self.name, self.fn = name, fn
        self.sums: dict[str, list[float]] = {}

    def to(self, device: torch.device) -> SumMetric:
        return self

    def update(self, output: Any, batch: Any) -> None:
        got = self.fn(output, batch)
        pairs = got.items() if isinstance(got, Mapping) else [(None, got)]
        for key, pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(
                    f"trainer.metrics.{self.name}: the function returned {describe(pair)}; return (sum, count), or a "
                    "dict of them"
                )
            name = self.name if key is None else f"{self.name}/{key}"
            total = self.sums.setdefault(name, [0.0, 0.0])
            total[0] += float(pair[0])
            total[1] += float(pair[1])

    def reduce(self, device: torch.device) -> dict[str, float]:
        names = sorted(self.sums)  # every rank ran the same batches: the same names
        flat = torch.tensor([x for n in names for x in self.sums[n]], dtype=torch.float64, device=device)
        dist.all_reduce(flat)
        self.sums = {}
        pairs = flat.view(-1, 2).tolist()
        return {n: s / c if c else float("nan") for n, (s, c) in zip(names, pairs)}
