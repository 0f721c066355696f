"""Saving checkpoints, collectively, atomically and durably: synchronous (`dcp.save`) or asynchronous
(`dcp.async_save`, under trainer.async_checkpoint). What is written, and what makes it complete, is
`launcher.checkpoint.format`; when a run saves is `launcher.checkpoint.policy`; a local folder or a URL,
`launcher.base.storage` (in object storage: written in place, the manifest last, no rename).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.durable import disk, fsync_dir
from launcher.base.hashing import xxh3
from launcher.base.storage import Location, write_durably, write_file
from launcher.checkpoint.format import (
    BEST,
    LATEST,
    MANIFEST,
    Position,
    checksum,
    complete,
    folder_name,
    latest,
    record,
    remove,
    rng_name,
    rng_state,
    writing_folder,
)
from launcher.checkpoint.hashing import hashing_writer
from launcher.checkpoint.space import check_space, checkpoint_bytes


@dataclass
class _Pending:
    """A save whose files are still being written in the background."""

    tmp: Location
    final: Location
    position: Position
    manifest: dict[str, Any]
    future: Any
    """DCP's: done on this rank when its write (and DCP's collective finish) is over; its result is the metadata."""
    sums: dict[str, str]
    """This rank's files and their checksums, filled by the background writer as it writes them."""


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
        checkpoints: Location,
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
        self.last: Location | None = None
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
        with self._writing(pending.position.step, pending.tmp):
            metadata = pending.future.result()  # DCP raises a failed write on every rank alike
            sums = self._gathered(pending.sums)
            self._make_visible(pending.tmp, pending.final, pending.position, pending.manifest, metadata, sums)

    @contextmanager
    def _writing(self, step: int, tmp: Location) -> Iterator[None]:
        """A full disk while the checkpoint of `step` is written, on any rank: its partial folder removed, and one
        line naming the disk, this checkpoint and the newest one still intact (object storage has no disk)."""
        try:
            yield
        except BaseException as e:
            # torch.save's writer reports a short write as "unexpected pos", not as the OSError behind it: a disk
            # left with less than a megabyte is full too
            if (
                isinstance(e, (KeyboardInterrupt, SystemExit))
                or not isinstance(self.checkpoints, Path)
                or (_no_space(e) is None and shutil.disk_usage(self.checkpoints).free >= 1 << 20)
            ):
                raise
            if self.rank == 0:
                remove(tmp)
            intact = self.last or latest(self.checkpoints)
            kept = f"the newest intact checkpoint is {intact}" if intact else "no checkpoint was saved before it"
            # a full disk that the check before the save did not foresee: another process wrote meanwhile
            raise RuntimeError(
                f"no space left on {disk(self.checkpoints)} while writing the checkpoint of step {step} ({tmp}, "
                f"removed); {kept}; free space there, lower trainer.keep_last, or choose another hydra.run.dir"
            ) from None

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
        final, tmp = self.checkpoints / folder_name(position.step), writing_folder(self.checkpoints, position.step)
        if self.rank == 0:
            remove(tmp)  # leftovers of a save that was killed (in object storage, or this step saved again)
            self.checkpoints.mkdir(parents=True, exist_ok=True)
        state = strategy.state_dict()
        if isinstance(self.checkpoints, Path):  # object storage has no free space to check
            intact = self.last or latest(self.checkpoints)
            check_space(  # collective
                self.checkpoints,
                checkpoint_bytes(state, self.world_size),
                1,
                f"the checkpoint of step {position.step}",
                f"; the newest intact checkpoint is {intact}" if intact else "; no checkpoint was saved before it",
            )
        with self._writing(position.step, tmp):  # a disk that fills while it is written (another writer)
            self._write(position, state, manifest, final, tmp)

    def _write(
        self, position: Position, state: dict[str, Any], manifest: dict[str, Any], final: Location, tmp: Location
    ) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self.rank == 0:
            tmp.mkdir(parents=True)
        dist.barrier()  # every rank writes after rank 0's removal of what was there
        sums: dict[str, str] = {}
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        sums[rng_name(self.rank)] = xxh3(rng.getbuffer())
        write_file(tmp / rng_name(self.rank), rng.getvalue())
        staged = self._stage(state) if self.asynchronous else None
        if staged is not None:
            del state  # training may change the live tensors now: the staged copy is what gets written
            future = dcp.async_save(
                staged,
                storage_writer=hashing_writer(tmp, sums),  # fsyncs every file it writes, hashes it meanwhile
                process_group=self._background_group(),
                async_stager=_Staged(),
            )
            self.pending = _Pending(tmp, final, position, manifest, future, sums)
            return
        metadata = dcp.save(state, storage_writer=hashing_writer(tmp, sums))  # fsyncs and hashes every file
        del state
        sums = self._gathered(sums)  # every shard and RNG file is on disk before the checkpoint becomes visible
        self._make_visible(tmp, final, position, manifest, metadata, sums)
        dist.barrier()

    def _gathered(self, sums: dict[str, str]) -> dict[str, str]:
        """Collective: every rank's checksums, on rank 0 (once every rank's write is over)."""
        import torch.distributed as dist

        every: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(sums, every if self.rank == 0 else None, dst=0)
        return {name: digest for rank_sums in every for name, digest in rank_sums.items()}

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
        self,
        tmp: Location,
        final: Location,
        position: Position,
        manifest: dict[str, Any],
        metadata: Any,
        sums: dict[str, str],
    ) -> None:
        """Rank 0, once every rank's files are on disk: manifest (sizes and the checksums computed as the files were
        written), rename (in object storage: none, the manifest written last makes it complete), `latest`,
        pruning."""
        if self.rank == 0:
            names = {info.relative_path for info in metadata.storage_data.values()} | {".metadata"}
            names |= {rng_name(r) for r in range(self.world_size)}
            missing = sorted(n for n in names if not (tmp / n).is_file())
            if missing:
                raise RuntimeError(
                    f"the checkpoint of step {position.step} lacks {', '.join(missing[:3])} in rank 0's view of {tmp}: "
                    "every rank must write into one shared run directory (hydra.run.dir on a file system every node "
                    "mounts)"
                )
            files = {n: (tmp / n).stat().st_size for n in sorted(names)}
            hashed = {n: sums.get(n) or checksum(tmp / n) for n in sorted(names)}  # read only if not hashed
            write_durably(tmp / MANIFEST, json.dumps(record(manifest, position, time.time(), files, hashed), indent=2))
            if tmp != final:  # a local folder: renamed into place
                shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a resumed run's last step)
                os.replace(tmp, final)
                fsync_dir(self.checkpoints)  # type: ignore[arg-type]
            write_durably(self.checkpoints / LATEST, final.name)
            if manifest.get("best"):  # trainer.early_stop's best step so far: named, and kept by the pruning
                write_durably(self.checkpoints / BEST, final.name)
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


def _no_space(error: BaseException) -> OSError | None:
    """The no-space error behind `error`, if that is what it is: DCP wraps each rank's failure in its own
    CheckpointException (`failures`: rank -> (exception, stack))."""
    import errno

    seen: list[BaseException] = [error]
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        seen += [f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
    for e in list(seen):
        while e.__cause__ or e.__context__:
            e = e.__cause__ or e.__context__  # type: ignore[assignment]
            seen.append(e)
    return next((e for e in seen if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)


def _same_containers(original: Any, staged: Any) -> Any:
    """DCP's staging turns tuples (AdamW's betas) into lists: give them back the original's containers."""
    if isinstance(original, dict):
        return {k: _same_containers(v, staged[k]) for k, v in original.items()}
    if isinstance(original, (list, tuple)):
        return type(original)(_same_containers(o, s) for o, s in zip(original, staged, strict=True))
    return staged


def _prune(checkpoints: Location, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints, newest by the order resume uses (`format.by_time`): after
    a fallback, an abandoned folder of a higher step is older than the saves made since, and goes first."""
    if keep_last <= 0:
        return
    best = checkpoints / BEST
    kept = best.read_text().strip() if best.exists() else None
    for old in complete(checkpoints)[keep_last:]:
        if old.name != kept:
            remove(old)
