"""The batch contract over any source of samples: the samples of optimizer step s depend on the seed and the global
batch B alone, never on the world size or the accumulation, so a run on G ranks with K micro-steps trains on what one
process with G*K does, and a resume at another world size goes on with the same samples.

Two kinds of source, one seam (`source_of`), the collate after either (`launcher.data.collate`):
- **Random access** (a map-style dataset, a `datasets.Dataset`): step s takes positions [sB, (s+1)B) of a seeded
  permutation per epoch (`launcher.data.builtin.GlobalBatches`); each rank reads and collates only its own share (rank r
  the r-th contiguous 1/G, cut into K micro-batches: `rank_micro_batches`), in `data.workers` DataLoader processes ahead
  of the loop. A resume starts at the sample index its checkpoint recorded.
- **A stream** (a torch `IterableDataset`, a `datasets.IterableDataset`, `streaming=True` or not): step s takes the
  stream's samples [sB, (s+1)B) in the order the stream gives them. Every rank reads the one stream, whole, and
  collates only its own share: no collective in the data path (nothing to hang on), a stream that ends is seen by
  every rank at the same sample, and its state after any step is the same on every rank and at any world size. The
  cost is reading (G - 1)/G of the samples only to pass them by; a reader process ahead of the loop
  (`data.workers=1`) hides it while one rank reads a global batch faster than a step trains. A resume loads the
  stream's own `state_dict` as the checkpoint recorded it after its last step (a `datasets.IterableDataset`, or any
  stream with `state_dict`/`load_state_dict`), or else reads past the samples consumed, said in one line with its
  cost. A stream that ends before `trainer.max_steps` ends the run on every rank at the same step (`Trainer.data`
  agrees on it in one all-reduce, before any forward).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import torch

from launcher.base.device import to_device
from launcher.data.builtin import GlobalBatches, rank_micro_batches
from launcher.data.collate import Collate


@dataclass
class StepData:
    """What one optimizer step trains on, on this rank."""

    micro: list[Any]
    """This rank's K micro-batches, collated and on the device."""
    state: dict[str, Any] | None = None
    """A stream's state after this step's samples (its `state_dict`), recorded with a checkpoint of this step."""
    sources: list[Any] | None = None
    """data=mix: per micro-batch, the source of each row (its index among the mixture's sources)."""


class EvalMicro(NamedTuple):
    """One micro-batch of an evaluation pass, on one rank."""

    batch: Any
    counted: bool
    """False: a stand-in (the global batch's first sample) where this rank's share of a partial last batch is empty,
    forwarded only so that every rank runs as many forwards as every other (a sharded model's forward is collective);
    its output counts in nothing."""


def evaluation_micro(
    samples: Any, at: np.ndarray, collate: Collate, rank: int, world_size: int, accumulation: int, device: torch.device
) -> list[EvalMicro]:
    """This rank's K micro-batches of one global batch of an evaluation: the samples of `samples` (anything indexed)
    at the positions `at` (B of them, or fewer for the last), rank r the r-th contiguous share cut into K, as in
    training; an empty one is a stand-in, the batch's first sample (`EvalMicro`)."""
    return [
        EvalMicro(
            to_device(collate([samples[int(at[j])] for j in (part if len(part) else [0])]), device), bool(len(part))
        )
        for part in rank_micro_batches(np.arange(len(at)), rank, world_size, accumulation)
    ]


def is_stream(dataset: Any) -> bool:
    """A source read in order (an iterable dataset) rather than by index."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def source_of(dataset: Any, global_size: int, seed: int, collate: Collate, stream_name: str = "data") -> Any:
    """The source a dataset is: `Stream` for an iterable, `RandomAccess` for anything indexed with a length, a
    mixture's own (`launcher.mixture.mix`) for data=mix."""
    if hasattr(dataset, "source_for"):
        return dataset.source_for(global_size, seed, collate, stream_name)
    if is_stream(dataset):
        return Stream(dataset, global_size, collate, stream_name)
    return RandomAccess(dataset, global_size, seed, collate)


def _as_is(batch: Any) -> Any:
    """The DataLoader's collate where the reader collated already (a module-level function: workers pickle it)."""
    return batch


@dataclass(frozen=True)
class Reading:
    """Who reads a source's training batches, and how (every source's `feed`): this rank among the data-parallel
    ranks, its micro-steps per optimizer step, the DataLoader processes reading ahead of the loop (0: in the loop),
    the device the batches go to, and `check(batch, n)`, which sees each host batch and its index (step x
    accumulation + k) before it is copied."""

    rank: int
    world_size: int
    accumulation: int
    workers: int = 0
    device: torch.device = torch.device("cpu")
    check: Callable[[Any, int], None] | None = None

    def on_device(self, batches: list[Any], step: int) -> list[Any]:
        """One step's host micro-batches, checked, on the device (pinned ones copied without blocking on CUDA)."""
        if self.check is not None:
            for k, batch in enumerate(batches):
                self.check(batch, step * self.accumulation + k)
        return [to_device(batch, self.device) for batch in batches]


def one_reader(reader: torch.utils.data.IterableDataset, reading: Reading, order: str) -> Iterator[Any]:
    """A source with one order (a stream, a mixture's draw) read by one DataLoader process ahead of the loop where
    `reading.workers` > 0, else in the loop; rank 0 says so where more were asked (`order`: what reads in one)."""
    from torch.utils.data import DataLoader

    workers = reading.workers
    if workers > 1 and reading.rank == 0:
        print(
            f"launch: data: data.workers={workers}: {order} by one process ahead of the loop, not {workers}", flush=True
        )
    loader = DataLoader(
        reader,
        batch_size=None,
        collate_fn=_as_is,
        num_workers=min(workers, 1),
        pin_memory=reading.device.type == "cuda",
        prefetch_factor=4 if workers > 0 else None,
    )
    return iter(loader)


class _StepBatches:
    """The micro-batch index lists one rank reads, step after step from a given position: a batch sampler."""

    def __init__(self, batches: GlobalBatches, start: int, steps: int, rank: int, world_size: int, accumulation: int):
        self.batches, self.start, self.steps = batches, start, steps
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation

    def __len__(self) -> int:
        return self.steps * self.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.steps):
            indices = self.batches.at(self.start + step * self.batches.global_size)
            for micro in rank_micro_batches(indices, self.rank, self.world_size, self.accumulation):
                yield micro.tolist()


class RandomAccess:
    """A dataset read by index: the seeded permutation's positions, each rank its own share."""

    ends = False
    """It never runs out: epochs follow one another, each in a permutation of its own."""

    def __init__(self, dataset: Any, global_size: int, seed: int, collate: Collate) -> None:
        self.dataset, self.collate = dataset, collate
        # Its permutation is data: held from the start. A dataset may give its own (a token store's, for locality).
        self.batches = GlobalBatches(len(dataset), global_size, seed, getattr(dataset, "epoch_order", None))

    def feed(self, position: Any, steps: int, reading: Reading) -> Iterator[StepData]:
        """This rank's micro-batches from `position` on, K per step, read by `reading.workers` DataLoader processes
        ahead of the loop (0: in the loop), collated, pinned and copied without blocking on CUDA. The order is the
        sampler's whatever the workers are."""
        from torch.utils.data import DataLoader

        K, workers = reading.accumulation, reading.workers
        sampler = _StepBatches(self.batches, position.samples, steps, reading.rank, reading.world_size, K)
        loader = DataLoader(
            self.dataset,
            batch_sampler=sampler,
            collate_fn=self.collate,
            num_workers=workers,
            pin_memory=reading.device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None,
            # Its own generator: starting to iterate draws the workers' base seed, which from the global generator
            # would shift dropout's draws in a resumed run (it starts iterating at the resumed step, not at step 1).
            generator=torch.Generator().manual_seed(0),
        )
        batches = iter(loader)
        for step in range(steps):
            yield StepData(reading.on_device([next(batches) for _ in range(K)], step))

    def evaluation(
        self, batches: int | None, rank: int, world_size: int, accumulation: int, device: torch.device
    ) -> Iterator[list[EvalMicro]]:
        """The set's first `batches` global batches (None: all of it), in order, each sample once: a set shorter
        than that is read once, whole, its last global batch partial; this rank's micro-batches of each."""
        B, n = self.batches.global_size, len(self.dataset)
        end = n if batches is None else min(n, batches * B)
        for start in range(0, end, B):
            at = np.arange(start, min(start + B, end))
            yield evaluation_micro(self.dataset, at, self.collate, rank, world_size, accumulation, device)

    def evaluated(self, batches: int | None) -> str:
        """What a pass reads of it, in words (said at start)."""
        B, n = self.batches.global_size, len(self.dataset)
        if batches is not None and batches * B < n:
            return (
                f"its first {batches * B:,} of {n:,} samples (trainer.eval_batches={batches} global batches of {B}; "
                "trainer.eval_batches=all reads every one)"
            )
        whole = f"all {n:,} samples, each once, in {-(-n // B)} global batch(es) of {B}"
        last = f" (the last holds {n % B})" if n % B else ""
        short = (
            f": it holds fewer than trainer.eval_batches={batches}" if batches is not None and batches * B > n else ""
        )
        return whole + last + short


def resumes_by_state(dataset: Any) -> tuple[bool, str]:
    """Whether a stream resumes exactly from its own `state_dict`, and if not, why: it keeps none, or it is a
    `datasets.IterableDataset` shuffled through a buffer, which its state leaves out (a resume from it would not
    give the samples an uninterrupted run gives)."""
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return False, "it keeps no state_dict"
    if _shuffle_buffer(dataset):
        return False, "its shuffle buffer is not in its state_dict"
    return True, ""


def _shuffle_buffer(dataset: Any) -> bool:
    """A `datasets.IterableDataset` shuffled through a buffer (`.shuffle(buffer_size=...)`), found in its chain of
    example iterables."""
    chain = [getattr(dataset, "_ex_iterable", None)]
    while chain:
        node = chain.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        chain += [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
    return False


class Stream:
    """An iterable dataset read in order: step s takes its samples [sB, (s+1)B), every rank reading them all."""

    ends = True
    """It may run out before trainer.max_steps: the ranks agree on it each step (`Trainer.data`)."""

    def __init__(self, dataset: Any, global_size: int, collate: Collate, name: str = "data") -> None:
        if getattr(dataset, "_distributed", None) is not None:  # datasets' split_dataset_by_node
            raise TypeError(
                f"{name} was split by node (datasets.distributed.split_dataset_by_node): each rank would read another "
                "stream, in an order that depends on the world size; return the whole stream: every rank reads it and "
                "keeps its own share of each global batch"
            )
        if iter(dataset) is dataset:
            raise TypeError(
                f"{name} is a one-shot iterator ({type(dataset).__name__}): a run reads its stream again to resume and "
                "to evaluate; return an IterableDataset (torch's, or a datasets.IterableDataset) whose __iter__ starts "
                "the stream from its beginning"
            )
        self.dataset, self.global_size, self.collate, self.name = dataset, global_size, collate, name

    def feed(self, position: Any, steps: int, reading: Reading) -> Iterator[StepData]:
        """This rank's micro-batches from `position` on, each step's with the stream's state after it; read in one
        DataLoader process ahead of the loop when `reading.workers` > 0 (a stream has one order: one reader), else
        in the loop. Ends early if the stream does."""
        reader = _StepReader(self, position, steps, reading.rank, reading.world_size, reading.accumulation)
        order = f"{self.name} is a stream, read in its one order"
        for step, (micro, state) in enumerate(one_reader(reader, reading, order)):
            yield StepData(reading.on_device(micro, step), state)

    def first(self, count: int) -> list[Any]:
        """The stream's first `count` samples (fewer if it has fewer)."""
        return list(islice(iter(self.dataset), count))

    def evaluation(
        self, batches: int | None, rank: int, world_size: int, accumulation: int, device: torch.device
    ) -> Iterator[list[EvalMicro]]:
        """The stream read once from its start, to its end or to `batches` global batches (None: to its end), its
        last global batch partial where it ends inside one; this rank's micro-batches of each."""
        samples, done = iter(self.dataset), 0
        while batches is None or done < batches:
            chunk = list(islice(samples, self.global_size))
            if not chunk:
                return
            at = np.arange(len(chunk))
            yield evaluation_micro(chunk, at, self.collate, rank, world_size, accumulation, device)
            if len(chunk) < self.global_size:
                return
            done += 1

    def evaluated(self, batches: int | None) -> str:
        """What a pass reads of it, in words (said at start)."""
        upto = "its end" if batches is None else f"its end or {batches} global batch(es) of {self.global_size}"
        return f"a stream, read once from its start to {upto}, each sample once"


class _StepReader(torch.utils.data.IterableDataset):
    """One rank's reading of a stream: every sample of each step read, its own share collated, the stream's state
    after the step attached; started where `position` says (its recorded state, or by reading past its samples)."""

    def __init__(self, stream: Stream, position: Any, steps: int, rank: int, world_size: int, accumulation: int):
        self.stream, self.position, self.steps = stream, position, steps
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation

    def __iter__(self) -> Iterator[tuple[list[Any], dict[str, Any] | None]]:
        dataset, B = self.stream.dataset, self.stream.global_size
        stateful, why = resumes_by_state(dataset)
        samples = self._started(dataset, stateful, why)
        mine = rank_micro_batches(np.arange(B), self.rank, self.world_size, self.accumulation)
        for _ in range(self.steps):
            chunk = list(islice(samples, B))
            if len(chunk) < B:  # the stream ended: a part of a global batch is never trained on
                return
            micro = [self.stream.collate([chunk[int(i)] for i in part]) for part in mine]
            yield micro, (_json_state(dataset.state_dict()) if stateful else None)

    def _started(self, dataset: Any, stateful: bool, why: str) -> Iterator[Any]:
        """An iterator over the stream from the position's sample on."""
        start, state = self.position.samples, getattr(self.position, "stream", None)
        if start and stateful and state is not None:
            dataset.load_state_dict(state)
            return iter(dataset)
        if stateful:  # its state was no plain data (JSON), so the checkpoint has none
            why = "the checkpoint records no state of it"
        samples = iter(dataset)
        if not start:
            return samples
        began = time.perf_counter()
        passed = sum(1 for _ in islice(samples, start))
        if self.rank == 0:
            print(
                f"launch: data: the stream resumed at sample {start:,} by reading past the {passed:,} before it in "
                f"{time.perf_counter() - began:.2f} s ({why}; every resume reads them again)",
                flush=True,
            )
        return samples


def _json_state(state: Any) -> dict[str, Any] | None:
    """A stream's state as a checkpoint's manifest records it (JSON: data, never code), or None where it is not
    plain data (the resume then reads past the samples instead)."""
    try:
        plain = json.loads(json.dumps(state))
    except (TypeError, ValueError):
        return None
    return plain if isinstance(plain, dict) else None
