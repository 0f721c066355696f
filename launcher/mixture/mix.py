"""data=mix: a weighted mixture of sources, each any data config (a built-in one, `custom`, `hf`, `text`, `store`),
under the batch contract: the samples of step s depend on the seed, the global batch and the weights alone.

**Which source fills each slot of step s.** Each source i carries a debt d_i: the samples its weight gave it so far
less the samples it got. A step adds B * w_i(s) (the weights at step s, renormalised over the sources still in) and
hands out the B slots one by one to the largest debt (ties: the source named first), each slot paying 1 (the
Megatron blend's rule, and a largest-remainder allocation where no debt is negative). So after any step every
source's count is within one sample of the sum of its B * w_i(t): the realised fraction over n steps is within
1 / (n B) of the mean weight, for any schedule. A seeded permutation of (seed, step) then spreads each source's
slots over the global batch, so every rank and micro-batch gets its share. The debts are a few floats of the
checkpoint: a resume at any world size, or with new weights, goes on from them.

**Each source keeps its own order and position.** Source i's k-th slot of step s takes its sample at position p_i + k,
p_i being how many samples it gave before: a map-style source's seeded permutation per epoch (a token store's
block-local one), repeating by epochs counted per source; a stream's order, every rank reading the samples of every
step and keeping its own (as `launcher.data.sources.Stream`), its `state_dict` recorded after each step. The
positions are global, never per rank: a resume at another world size is exact.

**A source that ends** (a stream, or a map-style one with `epochs` set) ends the run on every rank at the same step
(data.on_end=stop), or leaves the mixture (drop): its last samples are used, the slots it cannot fill go to the others
by the same rule, and its weight is 0 from then on, the others renormalised.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch

from launcher.base.device import to_device
from launcher.data.builtin import GlobalBatches, build_dataset, rank_micro_batches
from launcher.data.collate import Collate
from launcher.data.sources import (
    EvalMicro,
    Reading,
    StepData,
    Stream,
    _json_state,
    is_stream,
    one_reader,
    resumes_by_state,
)
from launcher.mixture.weights import SOURCE_KEYS, Ended, MixError, Weights, check_sources, plan

MIX_TARGET = "launcher.mixture.mix.Mix"
_SLOTS = 0x6D6978  # "mix": the permutation of slots draws from its own stream of the seed


@dataclass
class Part:
    """One source of the mixture, built for one split."""

    name: str
    dataset: Any
    weight: float
    epochs: int | None
    stream: bool
    batches: GlobalBatches | None = None
    """A map-style source's permutation per epoch (the run's seed; a token store's own order)."""

    def limit(self) -> int | None:
        """How many samples it can give before it ends (None: a stream, until it does; or repeating for ever)."""
        return None if self.stream or self.epochs is None else self.epochs * len(self.dataset)


def _node(node: Any) -> Any:
    from omegaconf import DictConfig, OmegaConf

    node = node if isinstance(node, DictConfig) else OmegaConf.create(node)
    return OmegaConf.masked_copy(node, [k for k in node if k not in SOURCE_KEYS])


class Mixture:
    """The sources of one split, built, with their weights; `source_of` makes it a source (`MixSource`)."""

    def __init__(self, split: str, sources: Any, schedule: Any, on_end: Any) -> None:
        self.weights = check_sources(sources, schedule, on_end)
        self.split, self.on_end = split, str(on_end)
        self.parts = []
        for name, node in sources.items():
            dataset = build_dataset(_node(node), split)
            epochs, stream = node.get("epochs"), is_stream(dataset)
            if stream and epochs is not None:
                raise MixError(
                    f"data.sources.{name}.epochs={epochs}: {name} is a stream, which ends when it runs out; "
                    "unset it (epochs count a map-style source's passes)"
                )
            self.parts.append(Part(str(name), dataset, float(node.get("weight")), epochs, stream))

    def source_for(self, global_size: int, seed: int, collate: Collate, name: str) -> MixSource:
        return MixSource(self, global_size, seed, collate, name)


def Mix(split: str, *, sources: Any, schedule: Any = (), on_end: Any = "stop") -> Mixture:
    """data=mix's target: the mixture of `sources` (NAME -> {weight, _target_, its keys}) for `split`."""
    return Mixture(split, sources, schedule, on_end)


def prepare(sources: Any, schedule: Any = (), on_end: Any = "stop", **_: Any) -> None:
    """Before any worker starts: the mixture's values checked, then each source's own `prepare` (data=text tokenizes
    its files), as the run's data would be."""
    from launcher.base.errors import ConfigError
    from launcher.base.targets import locate
    from launcher.data.builtin import LOADER_KEYS

    try:
        check_sources(sources, schedule, on_end)
    except MixError as e:
        raise ConfigError(str(e)) from e
    for node in sources.values():
        own = getattr(locate(str(node["_target_"])), "prepare", None)
        if callable(own):
            own(**{k: v for k, v in node.items() if k not in (*LOADER_KEYS, *SOURCE_KEYS, "_target_")})


Mix.prepare = prepare  # type: ignore[attr-defined]  # what the launcher runs once before the workers start


# ------------------------------------------------------------------ the source


class MixSource:
    """The mixture as a source (`launcher.data.sources`): `feed` and `evaluation` as a single source has them."""

    def __init__(self, mixture: Mixture, global_size: int, seed: int, collate: Collate, name: str) -> None:
        self.mixture, self.global_size, self.seed, self.collate, self.name = mixture, global_size, seed, collate, name
        for part in mixture.parts:
            if part.stream:
                Stream(part.dataset, global_size, collate, f"data.sources.{part.name} ({name})")  # its refusals
            else:
                order = getattr(part.dataset, "epoch_order", None)
                part.batches = GlobalBatches(len(part.dataset), global_size, seed, order)
        self.ends = any(p.stream or p.epochs is not None for p in mixture.parts)
        """A source may run out: the ranks agree on the end each step (`Trainer.data`)."""
        self.end: str | None = None
        """Why the mixture ended, once `feed` has (the run's last line names the source: `Trainer.ended`)."""

    def feed(self, position: Any, steps: int, reading: Reading) -> Iterator[StepData]:
        """This rank's micro-batches from `position` on, K per step, each step's with the mixture's state after it;
        read in one DataLoader process ahead of the loop when `reading.workers` > 0, else in the loop."""
        state = self.resumed(position, reading.rank)
        reader = _MixReader(self, state, position.step, steps, reading.rank, reading.world_size, reading.accumulation)
        order = "the mixture is read in its one order (each step's draw goes on from the state the step before left)"
        self.end = None
        for step, (micro, state, which) in enumerate(one_reader(reader, reading, order)):
            if micro is None:  # the reader's last word: why the mixture ends here
                self.end = state
                return
            yield StepData(reading.on_device(micro, step), {"mix": state}, which)

    def evaluation(
        self, batches: int | None, rank: int, world_size: int, accumulation: int, device: torch.device
    ) -> Iterator[list[EvalMicro]]:
        """The mixture's first `batches` global batches (None: until every source's split is read through), from
        every source's start, by the weights of steps 1 on, each sample once: every source is read once at most (a
        map-style one for one epoch, whatever its `epochs`) and leaves the mixture where it ends, the others taking
        its slots (data.on_end=drop); where every source ends inside a global batch, that last batch is partial.
        This rank's micro-batches of each: the same samples at every evaluation and world size."""
        once = copy.copy(self.mixture)
        once.on_end = "drop"
        once.parts = [dataclasses.replace(p, epochs=None if p.stream else 1) for p in self.mixture.parts]
        source = copy.copy(self)
        source.mixture = once
        steps = batches if batches is not None else 1 << 62  # to the end of every source
        reader = _MixReader(source, fresh(once), 0, steps, rank, world_size, accumulation, quiet=True, partial=True)
        for micro, _, which in reader:
            yield [EvalMicro(to_device(batch, device), bool(len(rows))) for batch, rows in zip(micro, which)]

    def evaluated(self, batches: int | None) -> str:
        """What a pass reads of it, in words (said at start)."""
        names = ", ".join(p.name for p in self.mixture.parts)
        upto = (
            "until each is read through"
            if batches is None
            else f"for {batches} global batch(es) of {self.global_size} at most"
        )
        return (
            f"a mixture of {names} by their weights, each source's samples once, a source that ends leaving the "
            f"others its slots, {upto}"
        )

    def alone(self) -> dict[str, MixSource]:
        """Each source by itself, as a mixture of one: its own validation loss (`launcher.worker.step`)."""
        out = {}
        for part in self.mixture.parts:
            one = copy.copy(self.mixture)
            one.parts, one.weights = [part], Weights({part.name: 1.0}, None)
            out[part.name] = MixSource(one, self.global_size, self.seed, self.collate, f"{self.name}: {part.name}")
        return out

    def resumed(self, position: Any, rank: int) -> dict[str, Any]:
        """The mixture's state at `position`: its checkpoint's, with the sources it did not know started afresh and
        a change of sources or weights said in one line (rank 0); fresh at step 0."""
        state = fresh(self.mixture)
        if rank == 0:
            print(
                f"launch: data: the mixture's weights: {self.mixture.weights.describe()}; a source that ends: "
                f"data.on_end={self.mixture.on_end}",
                flush=True,
            )
        saved = (position.stream or {}).get("mix") if isinstance(position.stream, dict) else None
        if position.step == 0:
            return state
        if saved is None:
            raise MixError(
                f"the checkpoint of step {position.step} was not written by data=mix (it records no mixture's "
                "positions): resume it with the data it was written with, or start this mixture afresh"
            )
        names = [p.name for p in self.mixture.parts]
        new = [n for n in names if n not in saved["sources"]]
        gone = [n for n in saved["sources"] if n not in names]
        for name in names:
            state["sources"][name] |= saved["sources"].get(name, {})
        old_w = saved.get("weights", {})
        now_w = self.mixture.weights.at(position.step) * [not state["sources"][n]["ended"] for n in names]
        now = {n: float(w / (now_w.sum() or 1.0)) for n, w in zip(names, now_w)}
        was = saved.get("schedule") if isinstance(saved.get("schedule"), dict) else None
        kept = [n for n in names if n in saved["sources"]]
        other = was is not None and _later(was, kept) != _later(state["schedule"], kept)
        changed = new or gone or other or any(abs(old_w.get(n, -1.0) - now[n]) > 1e-9 for n in names)
        # The bound holds for the future the allocation knew: the same schedule of the same sources goes on with it.
        # Any other, or a checkpoint that records none, starts the rule again from the debts (`plan`), which then sum
        # to 0 over the sources still in: what a source left out was owed goes to the others by their weights, as
        # when one ends (and what the earlier rule left unsettled when one ended, in a checkpoint written before).
        if was == state["schedule"]:
            state["bound"] = saved.get("bound")
        else:
            active = np.asarray([not state["sources"][n]["ended"] for n in names])
            owed = -sum(float(state["sources"][n]["debt"]) for n, a in zip(names, active) if a)
            ahead = self.mixture.weights.normalised(np.asarray([position.step + 1]), active)[0]
            for n, w in zip(names, ahead):
                state["sources"][n]["debt"] = float(state["sources"][n]["debt"]) + owed * float(w)
        if changed and rank == 0:
            said = ", ".join(f"{n} {old_w.get(n, 0):.3g}->{now[n]:.3g}" for n in names)
            more = (
                (f"; new: {', '.join(new)} (from its start)" if new else "")
                + (f"; left out: {', '.join(gone)}" if gone else "")
                + ("; another schedule" if other else "")
            )
            print(
                f"launch: data: the mixture changed since step {position.step} ({said}{more}); each source goes on "
                "from its own position",
                flush=True,
            )
        return state


def _later(schedule: dict[str, Any], names: list[str]) -> tuple[list[int], dict[str, list[float]]]:
    """A recorded schedule's points after step 0, for the sources `names`."""
    return schedule["steps"][1:], {n: schedule["weights"][n][1:] for n in names if n in schedule["weights"]}


def fresh(mixture: Mixture) -> dict[str, Any]:
    """The mixture's state before its first sample: each source's position, debt and end; the weights of the last
    step; the bound the allocation keeps (None: from the next step's debts, `restart_bound`) and the schedule it
    keeps it for."""
    sources = {p.name: {"samples": 0, "debt": 0.0, "ended": False, "stream": None} for p in mixture.parts}
    return {"weights": {}, "sources": sources, "bound": None, "schedule": mixture.weights.definition()}


class _MixReader(torch.utils.data.IterableDataset):
    """One rank's reading of the mixture: each step's allocation and slots (the same on every rank), every stream's
    samples of the step read and this rank's kept, its map-style samples read by index, its micro-batches collated,
    the state after the step attached."""

    def __init__(
        self,
        source: MixSource,
        state: dict[str, Any],
        done: int,
        steps: int,
        rank: int,
        world_size: int,
        accumulation: int,
        quiet: bool = False,
        partial: bool = False,
    ) -> None:
        self.source, self.state, self.done, self.steps = source, state, done, steps
        self.rank, self.world_size, self.accumulation, self.quiet = rank, world_size, accumulation, quiet
        self.partial = partial
        """An evaluation's: where every source ends inside a step, the samples read make a last, partial one."""

    def __iter__(self) -> Iterator[tuple[list[Any] | None, Any, list[np.ndarray] | None]]:
        source, parts, B = self.source, self.source.mixture.parts, self.source.global_size
        state = copy.deepcopy(self.state)
        rows = [state["sources"][p.name] for p in parts]
        streams = {i: self._started(p, rows[i]) for i, p in enumerate(parts) if p.stream and not rows[i]["ended"]}
        mine = rank_micro_batches(np.arange(B), self.rank, self.world_size, self.accumulation)
        for step in range(self.done + 1, self.done + self.steps + 1):
            taken = self._take(step, rows, streams, state)
            if isinstance(taken, str):  # the run ends: why, for its last line (training only)
                if not self.quiet:
                    yield None, taken, None
                return
            counts, chunks = taken
            slots = int(counts.sum())  # B; fewer in an evaluation's partial last batch
            labels = np.repeat(np.arange(len(parts)), counts)
            labels = labels[np.random.default_rng([source.seed, step, _SLOTS]).permutation(slots)]
            if slots < B:  # an evaluation's partial last batch: an empty share reads its first slot, counted in nothing
                mine = rank_micro_batches(np.arange(slots), self.rank, self.world_size, self.accumulation)
            nth = np.empty(slots, dtype=np.int64)  # each slot's place among its source's slots of the step
            for i in range(len(parts)):
                nth[labels == i] = np.arange(int(counts[i]))
            for i, p in enumerate(parts):  # a map-style source's sample indices of the step, from its position
                if not p.stream:
                    start = rows[i]["samples"]
                    chunks[i] = _Indexed(p, p.batches.of(np.arange(start, start + int(counts[i]))))  # type: ignore[union-attr]
            shares = [part if len(part) else np.zeros(1, dtype=np.int64) for part in mine]  # empty: a stand-in
            micro = [source.collate([chunks[int(labels[j])][int(nth[j])] for j in part]) for part in shares]
            which = [labels[part] for part in mine]
            for i, p in enumerate(parts):
                rows[i]["samples"] += int(counts[i])
                rows[i]["size"] = None if p.stream else len(p.dataset)
                if i in streams:
                    stateful = resumes_by_state(p.dataset)[0]
                    rows[i]["stream"] = _json_state(p.dataset.state_dict()) if stateful else None
            weights = self._weights(step, rows)
            state["weights"] = {p.name: float(w) for p, w in zip(parts, weights)}
            yield micro, copy.deepcopy(state), which

    def _weights(self, step: int, rows: list[dict[str, Any]]) -> np.ndarray:
        """The weights of `step` over the sources still in, normalised."""
        w = self.source.mixture.weights.at(step) * np.asarray([not r["ended"] for r in rows])
        return w / w.sum() if w.sum() > 0 else w

    def _take(
        self, step: int, rows: list[dict[str, Any]], streams: dict[int, Iterator[Any]], state: dict[str, Any]
    ) -> Any:
        """(counts per source, each stream's samples of the step), or why the run ends here (a line's words): a source
        ran out under on_end=stop, every source has, or the sources still in weigh nothing at this step. The counts are
        `plan`'s, from the debts and the bound in the state; a source that leaves under drop is said in one line."""
        parts, B, mixture = self.source.mixture.parts, self.source.global_size, self.source.mixture
        chunks: dict[int, list[Any]] = {i: [] for i in streams}

        def give(i: int, count: int) -> int:
            if i in streams:
                if count > len(chunks[i]):
                    chunks[i] += list(islice(streams[i], count - len(chunks[i])))
                return min(count, len(chunks[i]))
            limit = parts[i].limit()
            return count if limit is None else min(count, limit - rows[i]["samples"])

        debt = np.asarray([r["debt"] for r in rows], dtype=np.float64)
        ended = np.asarray([r["ended"] for r in rows], dtype=bool)
        planned = plan(mixture.weights, step, B, debt, ended, state.get("bound"), mixture.on_end, give)
        if isinstance(planned, Ended):
            if self.partial and planned.why == "out" and planned.counts is not None and planned.counts.sum() > 0:
                return planned.counts, chunks  # every source ended: an evaluation's samples read are its last batch
            return self._why(planned, step, rows)
        for i in planned.left:  # drop: its last samples are used, the slots it could not fill went to the others
            streams.pop(i, None)
            rows[i]["ended"] = True
            if not self.quiet and self.rank == 0:
                print(
                    f"launch: data: data.sources.{parts[i].name} ended after "
                    f"{rows[i]['samples'] + int(planned.counts[i]):,} samples at step {step}; it leaves the mixture "
                    f"(data.on_end=drop), and every count stays within {planned.bound:.3g} of its target from here",
                    flush=True,
                )
        for i, row in enumerate(rows):
            row["debt"] = float(planned.debt[i])
        state["bound"] = planned.bound
        return planned.counts, chunks

    def _why(self, ended: Ended, step: int, rows: list[dict[str, Any]]) -> str:
        """Why the mixture ends before `step`, in the words of the run's last line (`Trainer.ended`)."""
        names = [p.name for p in self.source.mixture.parts]
        if ended.why == "stop":
            had = rows[ended.source]["samples"] + ended.gave  # type: ignore[index]
            return f"data.sources.{names[ended.source]} ran out after {had:,} samples (data.on_end=stop)"  # type: ignore[index]
        if ended.why == "out":
            return "every source of the mixture has run out (data.on_end=drop" + (
                f"; the last was data.sources.{names[ended.source]})" if ended.source is not None else ")"
            )
        still = ", ".join(n for i, (n, r) in enumerate(zip(names, rows)) if not r["ended"] and i != ended.source)
        left = f"data.sources.{names[ended.source]} ran out and " if ended.source is not None else ""
        return f"{left}the sources still in the mixture ({still}) weigh 0 at step {step} (data.on_end=drop)"

    def _started(self, part: Part, row: dict[str, Any]) -> Iterator[Any]:
        """An iterator over a stream from its position on: its recorded state, or read past its samples."""
        dataset, start = part.dataset, row["samples"]
        stateful, why = resumes_by_state(dataset)
        if start and stateful and row.get("stream") is not None:
            dataset.load_state_dict(row["stream"])
            return iter(dataset)
        samples = iter(dataset)
        if not start:
            return samples
        began = time.perf_counter()
        passed = sum(1 for _ in islice(samples, start))
        if self.rank == 0 and not self.quiet:
            print(
                f"launch: data: data.sources.{part.name} resumed at sample {start:,} by reading past the {passed:,} "
                f"before it in {time.perf_counter() - began:.2f} s ({why or 'the checkpoint records no state of it'}"
                "; every resume reads them again)",
                flush=True,
            )
        return samples


class _Indexed:
    """A map-style source's samples of one step, read by index as they are asked for (a rank reads its own only)."""

    def __init__(self, part: Part, indices: np.ndarray) -> None:
        self.part, self.indices = part, indices

    def __getitem__(self, k: int) -> Any:
        return self.part.dataset[int(self.indices[k])]


def mix_figures(state: Any) -> dict[str, float]:
    """data=mix's figures from its state after a step (the same on every rank): each source's samples, its share of
    all samples so far, a map-style source's epochs begun and its input tokens so far; none for other data."""
    rows = (state or {}).get("mix", {}).get("sources", {}) if isinstance(state, dict) else {}
    total = sum(r["samples"] for r in rows.values()) or 1
    figures = {}
    for name, row in rows.items():
        figures[f"samples/{name}"] = float(row["samples"])
        figures[f"fraction/{name}"] = row["samples"] / total
        if row.get("size"):
            figures[f"epochs/{name}"] = float(-(-row["samples"] // row["size"]))
        if "tokens" in row:  # recorded by the worker after each step (`SourceLosses.recorded`)
            figures[f"tokens/{name}"] = float(row["tokens"])
    return figures
