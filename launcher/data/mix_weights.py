"""The weights of a mixture (launcher/data/mix.py): the sources' own, a schedule of them by step, their checks, and
the rule that turns them into each step's counts (`allocate`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SOURCE_KEYS = ("weight", "epochs")
"""A source's keys that are the mixture's, never passed to its target (`launcher.config.mix_schema`)."""


class MixError(ValueError):
    """A mixture the run cannot use: one line naming the value and the fix."""


def _number(value: Any, where: str) -> float:
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise MixError(f"{where}={value!r} is not a number; give a weight >= 0") from None
    if math.isnan(w) or math.isinf(w) or w < 0:
        raise MixError(f"{where}={value} is not a weight; give a finite number >= 0")
    return w


class Weights:
    """The weights by step: the sources' own at step 0, then each schedule point's, linear in between, the last held
    after it. Checked once (`MixError`, one line): weights >= 0 and finite, naming sources, a positive sum at every
    point, steps in increasing order."""

    def __init__(self, base: dict[str, float], schedule: list[Any] | None) -> None:
        self.names = list(base)
        points = [(0, [base[n] for n in self.names])]
        for i, point in enumerate(schedule or []):
            where = f"data.schedule[{i}]"
            if not isinstance(point, dict) or set(point) - {"step", "weights"} or "step" not in point:
                raise MixError(f"{where}={point!r} is not a point; write {{step: S, weights: {{NAME: W, ...}}}}")
            step = point["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step <= points[-1][0]:
                raise MixError(
                    f"{where}.step={step!r} does not come after step {points[-1][0]}: the schedule's steps must be "
                    "positive integers in increasing order"
                )
            weights = dict(zip(self.names, points[-1][1]))
            for name, value in (point.get("weights") or {}).items():
                if name not in weights:
                    raise MixError(f"{where}.weights.{name} names no source; the sources are {', '.join(self.names)}")
                weights[name] = _number(value, f"{where}.weights.{name}")
            if not sum(weights.values()) > 0:
                raise MixError(f"{where}: the weights sum to 0; give at least one source a weight above 0")
            points.append((step, [weights[n] for n in self.names]))
        self.steps = [s for s, _ in points]
        self.values = np.asarray([w for _, w in points], dtype=np.float64)

    def at(self, step: int) -> np.ndarray:
        """The weights of step `step` (not normalised)."""
        return np.asarray([np.interp(step, self.steps, self.values[:, i]) for i in range(len(self.names))])

    def describe(self) -> str:
        """The schedule in a few words, for the start line."""

        def point(i: int) -> str:
            total = self.values[i].sum()
            return "/".join(f"{w / total:.2g}" for w in self.values[i])

        parts = [f"{'/'.join(self.names)} = {point(0)}"]
        parts += [f"{point(i)} at step {s}" for i, s in enumerate(self.steps) if i]
        return ", linear to ".join(parts)


def allocate(total: int, debt: np.ndarray, active: np.ndarray) -> np.ndarray:
    """`total` slots over the active sources, one by one to the largest debt (ties: the first), each paying 1;
    `debt` is updated in place. Whole debts >= 1 are paid at once where they fit (the same counts, fewer turns)."""
    counts = np.zeros(len(debt), dtype=np.int64)
    whole = np.where(active, np.floor(np.maximum(debt, 0)), 0).astype(np.int64)
    if whole.sum() <= total:
        counts += whole
        debt -= whole
    for _ in range(total - int(counts.sum())):
        i = int(np.argmax(np.where(active, debt, -np.inf)))
        counts[i] += 1
        debt[i] -= 1
    return counts


def check_sources(sources: Any, schedule: Any, on_end: Any) -> Weights:
    """The mixture's own values checked (MixError, one line each): its sources and weights, the schedule, on_end."""
    if not sources:
        raise MixError("data.sources is empty; name the sources: data.sources.NAME={weight: W, _target_: ...}")
    base = {}
    for name, node in sources.items():
        if not hasattr(node, "get") or node.get("_target_") is None:
            raise MixError(f"data.sources.{name} has no _target_; give it a data config, e.g. "
                           "_target_: launcher.data.store.Store with its url")  # fmt: skip
        if node.get("weight") is None:
            raise MixError(f"data.sources.{name} has no weight; add data.sources.{name}.weight=W (W >= 0)")
        base[str(name)] = _number(node.get("weight"), f"data.sources.{name}.weight")
        collate = node.get("collate")
        if collate is not None and collate.get("_target_") is not None:
            raise MixError(f"data.sources.{name}.collate is set: one micro-batch holds samples of several sources, so "
                           "the mixture has one collate; set data.collate instead")  # fmt: skip
        epochs = node.get("epochs")
        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1):
            raise MixError(f"data.sources.{name}.epochs={epochs!r} is not a positive integer; give one, or leave it "
                           "unset (a map-style source repeats)")  # fmt: skip
    if not sum(base.values()) > 0:
        raise MixError(f"data.sources: the weights sum to {sum(base.values()):g}; give at least one source a weight "
                       "above 0")  # fmt: skip
    if str(on_end) not in ("stop", "drop"):
        raise MixError(f"data.on_end={on_end} is not stop or drop")
    return Weights(base, list(schedule or []))
