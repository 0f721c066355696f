"""Saving checkpoints, collectively, atomically and durably: synchronous (`dcp.save`) or asynchronous
(`dcp.async_save`, under trainer.async_checkpoint). The layout of what is written, and everything read back, is in
`launcher.checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.checkpoint import LATEST, MANIFEST, Position, is_complete
from launcher.durable import fsync_dir, write_durably
from strategies.base import local_bytes, tensors

SPACE_MARGIN = 1.1
"""Free space asked for before a save: the state's bytes and a tenth more (DCP's per-file headers, the manifest)."""


def save(
    checkpoints: Path,
    position: Position,
    strategy: Any,
    manifest: dict[str, Any],
    rank: int,
    world_size: int,
    keep_last: int,
) -> Path:
    """Save on every rank (collective), atomically: temp folder, barrier, rename, then the `latest` pointer."""
    saver = Saver(checkpoints, rank, world_size, keep_last)
    saver.save(position, strategy, manifest)
    return saver.last  # type: ignore[return-value]


@dataclass
class _Pending:
    """A save whose files are still being written in the background."""

    tmp: Path
    final: Path
    position: Position
    manifest: dict[str, Any]
    future: Any
    """DCP's: done on this rank when its write (and DCP's collective finish) is over; its result is the metadata."""


class Saver:
    """A run's saves, all collective: synchronous (`dcp.save`) or asynchronous (`dcp.async_save`).

    Asynchronous: `save` stages the state to host memory (pinned on CUDA) and returns while a background thread
    writes it, over a gloo group of its own (the training's collectives keep the default group to themselves).
    At most one save is in flight: the next `save` waits for it first. The folder stays `.step_N.partial`, with no
    manifest and the `latest` pointer unmoved, until every rank's write is over: the runner asks `writing()` each
    step and, once no rank writes, every rank calls `finalise()`; `finish()` (the end, a stop) waits for it.
    """

    def __init__(
        self,
        checkpoints: Path,
        rank: int,
        world_size: int,
        keep_last: int,
        asynchronous: bool = False,
        timeout: float = 600.0,
        pinned: bool = False,
    ) -> None:
        self.checkpoints, self.rank, self.world_size, self.keep_last = checkpoints, rank, world_size, keep_last
        self.asynchronous, self.timeout, self.pinned = asynchronous, timeout, pinned
        self.pending: _Pending | None = None
        self.last: Path | None = None
        """The newest checkpoint this saver made visible."""
        self.stall = 0.0
        """Seconds the caller was blocked in this saver since it last read (and reset) the figure."""
        self._group: Any = None
        self._buffers: Any = None

    @contextmanager
    def _stalling(self) -> Iterator[None]:
        """The block's seconds, added to `stall`: the loop waits for them."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stall += time.perf_counter() - started

    def save(self, position: Position, strategy: Any, manifest: dict[str, Any]) -> None:
        with self._stalling():
            self._finish()  # at most one save in flight
            self._save(position, strategy, manifest)

    def writing(self) -> bool:
        """This rank's background write is still going (no collective: the caller agrees over ranks)."""
        return self.pending is not None and not self.pending.future.done()

    def finalise(self) -> None:
        """Every rank, once no rank is writing (the caller agreed on it): rank 0 makes the checkpoint visible."""
        with self._stalling():
            self._finalise()

    def finish(self) -> None:
        """Collective: wait for the save in flight, if any, on every rank; then make it visible."""
        with self._stalling():
            self._finish()

    def _finalise(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        metadata = pending.future.result()  # DCP raises a failed write on every rank alike
        self._make_visible(pending.tmp, pending.final, pending.position, pending.manifest, metadata)

    def _finish(self) -> None:
        import torch.distributed as dist

        if self.pending is None:
            return
        try:
            self.pending.future.result(timeout=self.timeout)
        except TimeoutError as e:
            raise RuntimeError(
                f"the checkpoint of step {self.pending.position.step} was still being written after {self.timeout:g} s"
            ) from e
        except BaseException:
            pass  # raised again by _finalise, on every rank alike
        dist.barrier()  # every rank's write is over before rank 0 makes it visible
        self._finalise()

    def _save(self, position: Position, strategy: Any, manifest: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        name = f"step_{position.step:08d}"
        final, tmp = self.checkpoints / name, self.checkpoints / f".{name}.partial"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        state = strategy.state_dict()
        _check_space(self.checkpoints, state)
        with open(tmp / f"rng_{self.rank}.pt", "wb") as f:
            torch.save(_rng_state(), f)
            f.flush()
            os.fsync(f.fileno())
        staged = self._stage(state) if self.asynchronous else None
        if staged is not None:
            del state  # training may change the live tensors now: the staged copy is what gets written
            future = dcp.async_save(
                staged,
                storage_writer=dcp.FileSystemWriter(str(tmp)),  # fsyncs every file it writes
                process_group=self._background_group(),
                async_stager=_Staged(),
            )
            self.pending = _Pending(tmp, final, position, manifest, future)
            return
        metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))  # fsyncs every file it writes
        del state
        dist.barrier()  # every shard and RNG file is on disk before the checkpoint becomes visible
        self._make_visible(tmp, final, position, manifest, metadata)
        dist.barrier()

    def _stage(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """A host copy of `state` that training cannot change (collective); None, with a note, where a rank cannot
        make one: then this save and the later ones are synchronous."""
        import torch
        import torch.distributed as dist

        try:
            staged, problem = _same_containers(state, self._copy_to_host(state)), None
        except (ValueError, TypeError, RuntimeError) as e:
            staged, problem = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"
        failed = torch.tensor([float(problem is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._background_group())
        if not failed.item():
            return staged
        if self.rank == 0:
            why = f" ({problem})" if problem else " (on another rank)"
            print(f"launch: trainer.async_checkpoint: this state cannot be staged{why}; saving synchronously")
        self.asynchronous = False
        return None

    def _copy_to_host(self, state: dict[str, Any]) -> dict[str, Any]:
        """DCP's staging copy, into host buffers allocated at the first save (pinned on CUDA) and reused by the
        later ones: one save in flight, so the previous write is over before they are overwritten."""
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        if self._buffers is not None:
            try:
                return _copy_state_dict(state, self._buffers)
            except CompanionMismatch:  # another structure: new buffers
                pass
        self._buffers = _create_cpu_state_dict(state, pin_memory=self.pinned)
        return _copy_state_dict(state, self._buffers)

    def _background_group(self) -> Any:
        """A gloo group for the background writes (collective, made once): DCP's async save needs a CPU backend,
        and the default group's collectives belong to the training loop running meanwhile."""
        import datetime

        import torch.distributed as dist

        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self._group

    def _make_visible(
        self, tmp: Path, final: Path, position: Position, manifest: dict[str, Any], metadata: Any
    ) -> None:
        """Rank 0, once every rank's files are on disk: manifest, rename, `latest`, pruning."""
        if self.rank == 0:
            names = {info.relative_path for info in metadata.storage_data.values()} | {".metadata"}
            names |= {f"rng_{r}.pt" for r in range(self.world_size)}
            missing = sorted(n for n in names if not (tmp / n).is_file())
            if missing:
                raise RuntimeError(
                    f"the checkpoint of step {position.step} lacks {', '.join(missing[:3])} in rank 0's view of {tmp}: "
                    "every rank must write into one shared run directory (hydra.run.dir on a file system every node "
                    "mounts)"
                )
            files = {n: (tmp / n).stat().st_size for n in sorted(names)}
            record = {
                **manifest,
                "step": position.step,
                "samples": position.samples,
                "time": time.time(),
                "files": files,
            }
            write_durably(tmp / MANIFEST, json.dumps(record, indent=2))
            shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a resumed run's last step)
            os.replace(tmp, final)
            fsync_dir(self.checkpoints)
            write_durably(self.checkpoints / LATEST, final.name)
            _prune(self.checkpoints, self.keep_last)
        self.last = final


class _Staged:
    """DCP's stager for a state already staged: `_stage` made the copy (and every rank agreed it could)."""

    should_synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _same_containers(original: Any, staged: Any) -> Any:
    """DCP's staging turns tuples (AdamW's betas) into lists: give them back the original's containers."""
    if isinstance(original, dict):
        return {k: _same_containers(v, staged[k]) for k, v in original.items()}
    if isinstance(original, (list, tuple)):
        return type(original)(_same_containers(o, s) for o, s in zip(original, staged, strict=True))
    return staged


def _check_space(checkpoints: Path, state: dict[str, Any]) -> None:
    """Collective: every rank's state bytes summed, against the free space rank 0 sees; one line if short."""
    import torch
    import torch.distributed as dist

    local = sum(local_bytes(t) for t in tensors(state))
    figures = torch.tensor([float(local), float(shutil.disk_usage(checkpoints).free)], dtype=torch.float64)
    needed = figures[:1].clone()
    dist.all_reduce(needed)
    dist.broadcast(figures, src=0)  # rank 0's free space: the folder is shared
    needed_bytes, free = SPACE_MARGIN * float(needed.item()), float(figures[1].item())
    if free < needed_bytes:
        raise RuntimeError(
            f"{checkpoints} has {free / 1e6:,.0f} MB free but the checkpoint needs about {needed_bytes / 1e6:,.0f} MB; "
            "free space there, lower trainer.keep_last, or choose another hydra.run.dir"
        )


def _prune(checkpoints: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in checkpoints.glob("step_*") if is_complete(p))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ loading


def _rng_state() -> dict[str, Any]:
    """The generators training draws from (dropout); the data order is a pure function of seed and position."""
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state
