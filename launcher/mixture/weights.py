"""The weights of a mixture (launcher/mixture/mix.py): the sources' own, a schedule of them by step, their checks, and
the rule that turns them into each step's counts (`allocate`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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
        return self._between(np.asarray([step]))[0]

    def _between(self, steps: np.ndarray) -> np.ndarray:
        """The weights of `steps` (a row each, not normalised): linear between the points either side, the last held."""
        points = np.asarray(self.steps)
        at = np.maximum(np.searchsorted(points, steps, side="right") - 1, 0)
        after = np.minimum(at + 1, len(points) - 1)
        part = np.minimum((steps - points[at]) / np.maximum(points[after] - points[at], 1), 1.0)[:, None]
        return self.values[at] * (1 - part) + self.values[after] * part

    def definition(self) -> dict[str, Any]:
        """The weights as plain data (a checkpoint's): the points' steps and each source's weights at them."""
        return {
            "steps": [int(x) for x in self.steps],
            "weights": {n: [float(w) for w in self.values[:, i]] for i, n in enumerate(self.names)},
        }

    def normalised(self, steps: np.ndarray, active: np.ndarray) -> np.ndarray:
        """The weights of `steps` (a row each) over the active sources, normalised (0 where none of them weighs)."""
        v = self._between(steps) * active
        total = v.sum(-1, keepdims=True)
        return np.divide(v, total, out=np.zeros_like(v), where=total > 0)

    def due(self, step: int, size: int, active: np.ndarray, sources: np.ndarray, needs: np.ndarray) -> np.ndarray:
        """For each source and need (samples, >= 0): when its target from step `step` + 1 on (`size` times its weight a
        step, over the active sources) first passes the need, as a real step: T - 1 plus the part of step T's target
        it takes to pass it, T the step it passes in; inf if it never does. After the schedule's last point the
        weights hold, so the scan ends there."""
        keys, total = np.full(len(sources), np.inf), np.zeros(len(sources))
        todo, first, span, last = np.arange(len(sources)), step + 1, 1, self.steps[-1]
        while len(todo):
            if first > last:  # constant from here on: in closed form
                rate = size * self.normalised(np.asarray([first]), active)[0, sources[todo]]
                safe = np.where(rate > 0, rate, 1.0)
                keys[todo] = np.where(rate > 0, first - 1 + (needs[todo] - total[todo]) / safe, np.inf)
                return keys
            end = min(first + span, last + 1)
            per = size * self.normalised(np.arange(first, end), active)[:, sources[todo]]
            cum = total[todo] + np.cumsum(per, axis=0)
            passed = cum > needs[todo]
            hit, at = passed.any(axis=0), passed.argmax(axis=0)
            now = todo[hit]
            cols = np.flatnonzero(hit)
            before = np.where(at[hit] > 0, cum[np.maximum(at[hit] - 1, 0), cols], total[now])
            keys[now] = first + at[hit] - 1 + (needs[now] - before) / per[at[hit], cols]
            total[todo] = cum[-1]
            todo, first, span = todo[~hit], end, span * 4
        return keys

    def describe(self) -> str:
        """The schedule in a few words, for the start line."""

        def point(i: int) -> str:
            total = self.values[i].sum()
            return "/".join(f"{w / total:.2g}" for w in self.values[i])

        parts = [f"{'/'.join(self.names)} = {point(0)}"]
        parts += [f"{point(i)} at step {s}" for i, s in enumerate(self.steps) if i]
        return ", linear to ".join(parts)


def margin(n: int) -> float:
    """The rule's margin for a mixture of `n` sources, 1/(2n - 2) (Tijdeman's; 1/2 for one source, which is exact): a
    source is served only while it is owed at least the margin, and before it is owed more than 1 - margin."""
    return 1.0 / (2 * n - 2) if n > 1 else 0.5


def restart_bound(debt: np.ndarray, slots: int, active: np.ndarray, delta: float) -> float:
    """The bound the rule keeps from here on, for the future weights as they stand (see `allocate`): the smallest b
    >= 1 - delta with sum_i max(0, y_i + 1 - b) <= slots + 1 and b >= -min_i y_i, y the active sources' debts with the
    targets of these `slots` added. From a fresh start (y = B * w) it is 1 - delta."""
    y = debt[active]
    if not len(y):
        return 1.0 - delta
    top = np.cumsum(np.sort(y + 1.0)[::-1])
    need = max(float(np.max((top - (slots + 1)) / np.arange(1, len(y) + 1))), -float(y.min()))
    return 1.0 - delta if need <= 1.0 - delta + 1e-9 else need  # within 1e-9: the sums' rounding, not a need


Due = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(sources, needs) -> when each source's target from the next step on passes its need, as a real step."""


def allocate(slots: int, debt: np.ndarray, active: np.ndarray, bound: float, delta: float, due: Due) -> np.ndarray:
    """`slots` samples over the active sources, whose debts (what their weights gave them so far less what they got,
    these slots' targets included) are `debt`, paid in place: Tijdeman's chairman rule, a step at a time. A source's
    k-th sample to come is *ready* once its debt reaches k - 1 + delta (serving it leaves a debt >= delta - 1) and *due*
    at the step its debt passes k - 1 + bound. The samples due now are served; the slots left go to ready samples by
    the step they fall due (`due`, the moment within that step breaking ties, then the source named first): earliest
    deadline first. While the premises hold (docs/data.md) nothing due is ever late and enough samples are ready;
    were they not, the largest debts fill what is left."""
    n = len(debt)
    counts = np.zeros(n, dtype=np.int64)
    must = np.where(active, np.maximum(np.ceil(debt - bound), 0), 0).astype(np.int64)
    ready = np.maximum(np.where(active, np.maximum(np.floor(debt + 1 - delta), 0), 0).astype(np.int64), must)
    if must.sum() <= slots:
        counts += must
        left = slots - int(must.sum())
        if left:
            extra = np.minimum(ready - must, left)
            sources = np.repeat(np.arange(n), extra)
            nth = np.arange(len(sources)) - np.repeat(np.cumsum(extra) - extra, extra)
            needs = np.maximum(nth + bound - (debt[sources] - must[sources]), 0.0)
            order = np.lexsort((nth, sources, due(sources, needs)))[:left]
            np.add.at(counts, sources[order], 1)
    debt -= counts
    for _ in range(slots - int(counts.sum())):  # beyond the premises only
        i = int(np.argmax(np.where(active, debt, -np.inf)))
        counts[i] += 1
        debt[i] -= 1
    return counts


@dataclass
class Planned:
    """One step of the mixture: each source's samples, the debts and ends after it, and the bound they keep."""

    counts: np.ndarray
    debt: np.ndarray
    ended: np.ndarray
    bound: float
    left: list[int]
    """The sources that ran out in this step and left the mixture (data.on_end=drop), in the order found."""


@dataclass
class Ended:
    """Why the mixture ends before this step: `source` ran out, having `gave` samples left for it (on_end=stop), or
    every source has run out, `source` the last (drop), or the sources still in weigh nothing at the step."""

    why: str
    """"stop", "out" or "weightless"."""
    source: int | None = None
    gave: int = 0
    counts: np.ndarray | None = None
    """Where every source ran out within the step: the samples each gave in it (an evaluation's last, partial batch)."""


def plan(
    weights: Weights,
    step: int,
    size: int,
    debt: np.ndarray,
    ended: np.ndarray,
    bound: float | None,
    on_end: str,
    give: Callable[[int, int], int],
) -> Planned | Ended:
    """Step `step`'s `size` slots: each source's count by `allocate`, from the debts and ends after the step before
    and the bound they keep (None: the rule starts here, as at a resume with another mixture). `give(i, count)` says
    how many of `count` samples source i can give (count only grows within a step). A source that cannot give them
    ends the run (on_end=stop), or leaves (drop): its target is closed at what it gave, what it was still owed goes
    to the others by their weights of the step, and the rule starts again from there for the slots it left open."""
    delta = margin(len(debt))
    debt, ended = np.array(debt, dtype=np.float64), np.array(ended, dtype=bool)
    active = ~ended
    w = weights.at(step) * active
    if not w.sum() > 0:
        return Ended("weightless" if active.any() else "out")
    w = w / w.sum()
    debt = np.where(active, debt + size * w, 0.0)

    def due(sources: np.ndarray, needs: np.ndarray) -> np.ndarray:
        return weights.due(step, size, active, sources, needs)

    if bound is None or bound > 1.0 - delta:  # a new start, or one that may come back down: from these debts
        fresh = restart_bound(debt, size, active, delta)
        bound = fresh if bound is None else min(bound, fresh)
    counts, left = allocate(size, debt, active, bound, delta, due), []
    while True:
        short = None
        for i in np.flatnonzero(active):
            got = give(int(i), int(counts[i]))
            if got < counts[i]:
                short = (int(i), got)
                break
        if short is None:
            return Planned(counts, debt, ended, bound, left)
        i, got = short
        if on_end == "stop":
            return Ended("stop", i, got)
        owed, open_slots = debt[i] + counts[i] - got, int(counts[i]) - got
        active[i], ended[i], counts[i], debt[i] = False, True, got, 0.0
        left.append(i)
        rest = w * active
        if not rest.sum() > 0:
            return Ended("weightless", i) if active.any() else Ended("out", i, got, counts)
        debt += owed * rest / rest.sum()
        bound = restart_bound(debt, open_slots, active, delta)
        counts += allocate(open_slots, debt, active, bound, delta, due)


def check_sources(sources: Any, schedule: Any, on_end: Any) -> Weights:
    """The mixture's own values checked (MixError, one line each): its sources and weights, the schedule, on_end."""
    if not sources:
        raise MixError("data.sources is empty; name the sources: data.sources.NAME={weight: W, _target_: ...}")
    base = {}
    for name, node in sources.items():
        if not hasattr(node, "get") or node.get("_target_") is None:
            raise MixError(
                f"data.sources.{name} has no _target_; give it a data config, e.g. "
                "_target_: launcher.data.store.Store with its url"
            )
        if node.get("weight") is None:
            raise MixError(f"data.sources.{name} has no weight; add data.sources.{name}.weight=W (W >= 0)")
        base[str(name)] = _number(node.get("weight"), f"data.sources.{name}.weight")
        collate = node.get("collate")
        if collate is not None and collate.get("_target_") is not None:
            raise MixError(
                f"data.sources.{name}.collate is set: one micro-batch holds samples of several sources, so "
                "the mixture has one collate; set data.collate instead"
            )
        epochs = node.get("epochs")
        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1):
            raise MixError(
                f"data.sources.{name}.epochs={epochs!r} is not a positive integer; give one, or leave it "
                "unset (a map-style source repeats)"
            )
    if not sum(base.values()) > 0:
        raise MixError(
            f"data.sources: the weights sum to {sum(base.values()):g}; give at least one source a weight above 0"
        )
    if str(on_end) not in ("stop", "drop"):
        raise MixError(f"data.on_end={on_end} is not stop or drop")
    return Weights(base, list(schedule or []))
