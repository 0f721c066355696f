"""The memory tier from the workers' side (`launcher.recovery.shm` is what a node's folder holds).

Every trainer.memory_checkpoint_every steps each rank copies its state to host memory (the loop waits for that copy
only), and a thread of its own writes it as DCP writes a checkpoint, into its node's folder in shared memory (it
outlives the worker), then sends its files to trainer.memory_replicas other nodes, the next ones in a ring, which
keep them in theirs. Two gloo groups of the tier's own carry it: DCP's collectives and the replicas' bytes; the
training keeps the default group. At most one step is in flight: the next waits for it.

After a restart, before the disk tier is read, `promote` finds the newest step complete across the surviving nodes'
memory; the survivors write its files into a normal checkpoint in the run's checkpoint folder, rank 0 its manifest,
and the job resumes through the path that exists (`launcher.checkpoint.resume`): exact at any world size, as DCP
reshards. None complete: the disk tier, said in one line.
"""

from __future__ import annotations

import datetime
import functools
import io
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.base.hashing import xxh3
from launcher.base.storage import Location, is_remote, write_durably
from launcher.checkpoint.format import (
    LATEST,
    MANIFEST,
    Position,
    by_time,
    manifest_of,
    read_manifest,
    record,
    remove,
    rng_name,
    rng_state,
    writing_folder,
)
from launcher.checkpoint.hashing import hashing_writer
from launcher.checkpoint.saving import _same_containers
from launcher.recovery import shm as memory
from launcher.recovery.replicas import Replica


class MemoryTier:
    """This rank's part of the memory tier; every method is a no-op where trainer.memory_checkpoint_every is 0."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        folder = os.environ.get(memory.TIER_ENV)
        self.every = int(cfg.trainer.memory_checkpoint_every) if folder and memory.tier_on(cfg.trainer) else 0
        self.ctx, self.rank, self.world = ctx, ctx.rank, ctx.world_size
        self.per_node = int(ctx.local_world_size or ctx.world_size)
        nodes = max(1, self.world // self.per_node)
        self.replicas = memory.replicas(cfg.trainer, nodes)  # elastic: fewer nodes than it asks
        self.folder = Path(folder) if folder else Path()
        self.manifest = manifest_of(cfg, ctx.world_size, ctx.precision)
        self.resumed: dict[str, Any] | None = None
        """What `promote` decided, told in one line after the first step trained again."""
        self.pending: Future[None] | None = None
        self._buffers: Any = None
        self._previous: int | None = None
        self.replica: Replica | None | bool = False
        """Where every rank holds the whole state (ddp), the state itself is the copy (`launcher.recovery.replicas`):
        decided at the first step."""
        if not self.every:
            return
        timeout = datetime.timedelta(seconds=float(cfg.trainer.collective_timeout))
        self._dcp = dist.new_group(backend="gloo", timeout=timeout)  # collective: every rank, in this order
        self._send = dist.new_group(backend="gloo", timeout=timeout)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-tier")
        self.folder.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ each step

    def after(self, position: Position, strategy: Any) -> None:
        """After step `position.step`: its time noted, the resume line once, and its state saved where it is due."""
        if not self.every:
            return
        step = position.step
        if self.ctx.local_rank == 0:
            memory.mark_last(self.folder, step, time.time())
        if self.resumed is not None:
            self._tell(step)
        if self.replica is False:
            self.replica = Replica.of(strategy)
        if isinstance(self.replica, Replica):  # replicas are the copy: none made, the step noted
            self.replica.ended(position, rng_state())
            return
        if step % self.every:
            return
        self.wait()
        state = strategy.state_dict()
        staged = _same_containers(state, self._copy_to_host(state))
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        self.pending = self._thread.submit(self._write, position, staged, rng.getvalue())

    def wait(self) -> None:
        """The step in flight written and replicated (its error, if any, raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def on_failure(self, strategy: Any) -> None:
        """The job failed: where the state is the tier's copy (replicas), this rank's written into its node's folder
        once, as the step it last completed, for the restart to promote."""
        if not self.every or not isinstance(self.replica, Replica):
            return
        import logging

        try:
            said = self.replica.write(self.folder, strategy, self.rank, self.world, self.manifest)
        except Exception as e:  # the failure being reported is the job's, not this write's
            said = f"writing its state failed ({type(e).__name__}: {e})"
        logging.getLogger(__name__).warning("launch: memory tier: rank %d: %s", self.rank, said)

    def close(self) -> None:
        if self.every:
            self.wait()
            self._thread.shutdown()

    def _copy_to_host(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy training cannot change, into host buffers made once and reused (one step in flight)."""
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        if self._buffers is not None:
            try:
                return _copy_state_dict(state, self._buffers)
            except CompanionMismatch:
                pass
        self._buffers = _create_cpu_state_dict(state, pin_memory=self.ctx.device_type == "cuda")
        return _copy_state_dict(state, self._buffers)

    def _write(self, position: Position, staged: dict[str, Any], rng: bytes) -> None:
        """In the tier's thread: this rank's files of the step into its node's folder, then to its replicas."""
        import torch.distributed.checkpoint as dcp

        step, folder = position.step, memory.step_folder(self.folder, position.step)
        folder.mkdir(parents=True, exist_ok=True)
        sums: dict[str, str] = {}
        dcp.save(
            staged,
            storage_writer=hashing_writer(folder, sums),
            planner=_planner()(enable_plan_caching=True),
            process_group=self._dcp,
        )
        if self.ctx.local_rank == 0:  # every rank is past the previous step's replicas (DCP's collective)
            memory.clear(self.folder, {step} | ({self._previous} if self._previous is not None else set()))
        self._previous = step
        sums[rng_name(self.rank)] = xxh3(rng)
        (folder / rng_name(self.rank)).write_bytes(rng)
        files = {name: _read(folder / name) for name in sums}  # read once, sent as they are
        sizes = {name: int(t.numel()) for name, t in files.items()}
        marker = {
            "rank": self.rank,
            "step": step,
            "world_size": self.world,
            "node": str(self.folder),
            "time": time.time(),
            "files": sizes,
            "sums": sums,
        }
        if self.rank == 0:
            stream = {"stream": position.stream} if position.stream is not None else {}
            marker |= {"samples": position.samples, **stream, "manifest": self.manifest}
        memory.put(self.folder, step, {}, marker)
        for k in range(1, self.replicas + 1):
            theirs, their_files = self._exchange(
                marker,
                files,
                (self.rank + k * self.per_node) % self.world,
                (self.rank - k * self.per_node) % self.world,
            )
            memory.put(self.folder, step, their_files, theirs)

    def _exchange(
        self, marker: dict[str, Any], files: dict[str, torch.Tensor], to: int, source: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's marker and files to rank `to`, and rank `source`'s from it, over the tier's own group: the
        markers' lengths, the markers, then every file at once (a marker names its files and their sizes)."""
        group = self._send

        def both(mine: torch.Tensor, theirs: torch.Tensor) -> None:
            for req in (dist.isend(mine, to, group=group), dist.irecv(theirs, source, group=group)):
                req.wait()

        header = torch.frombuffer(bytearray(json.dumps(marker).encode()), dtype=torch.uint8)
        length = torch.zeros(1, dtype=torch.int64)
        both(torch.tensor([header.numel()], dtype=torch.int64), length)
        got = torch.empty(int(length), dtype=torch.uint8)
        both(header, got)
        theirs = json.loads(got.numpy().tobytes())
        received = {name: torch.empty(size, dtype=torch.uint8) for name, size in theirs["files"].items()}
        requests = [dist.isend(t, to, group=group) for t in files.values()]
        requests += [dist.irecv(t, source, group=group) for t in received.values()]
        for req in requests:
            req.wait()
        return theirs, {name: t.numpy() for name, t in received.items()}

    # ------------------------------------------------------------------ after a restart

    def promote(self, checkpoints: Location) -> None:
        """Collective, before the disk tier is read: the newest step complete across the nodes' memory becomes a
        normal checkpoint in `checkpoints`, newer than any there, where it is newer than the disk tier's newest."""
        if not self.every:
            return
        view = (str(self.folder), memory.held(self.folder)) if self.ctx.local_rank == 0 else None
        views: list[Any] = [None] * self.world
        dist.all_gather_object(views, view)
        nodes = dict(v for v in views if v is not None)
        decision: list[Any] = [None]
        if self.rank == 0:
            decision[0] = self._decide(nodes, checkpoints)
        dist.broadcast_object_list(decision, src=0)
        step, plan, self.resumed = decision[0]
        if step is not None:
            target = writing_folder(checkpoints, step)
            if self.rank == 0:
                remove(target)
                target.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if self.ctx.local_rank == 0 and str(self.folder) in plan:
                memory.copy_out(self.folder, step, plan[str(self.folder)], target)
            dist.barrier()
            if self.rank == 0:
                self._make_visible(checkpoints, target, step, nodes)
            dist.barrier()
        if self.ctx.local_rank == 0 and self.resumed is not None:  # the disk tier holds it now, or it is no use
            memory.clear(self.folder)

    def _decide(self, nodes: dict[str, dict[str, Any]], checkpoints: Location) -> tuple[Any, ...]:
        """Rank 0: (step to promote or None, {node: [ranks whose files it writes]}, what the resume line says)."""
        if not any(v["steps"] or v["last"] for v in nodes.values()):
            return None, {}, None  # a first start: nothing to say
        step, holders, why = memory.choose(nodes)
        last = memory.last_trained(nodes)
        newest = by_time(checkpoints)
        on_disk = int(read_manifest(newest[0])["step"]) if newest else None
        if step is not None and on_disk is not None and on_disk >= step:  # a stop or a resize saved it there
            return None, {}, {"tier": "disk", "why": f"it holds step {on_disk} already", "last": last}
        told = {"tier": "memory" if step is not None else "disk", "why": why, "last": last}
        if step is None:
            print(f"launch: memory tier: {why}; resuming from the disk tier", flush=True)
            return None, {}, told
        plan: dict[str, list[int]] = {}
        for rank, node in holders.items():
            plan.setdefault(node, []).append(int(rank))
        return step, plan, told

    def _make_visible(self, checkpoints: Location, target: Location, step: int, nodes: dict[str, Any]) -> None:
        """Rank 0: the manifest of the promoted step (its files' sizes and checksums, as each rank wrote them), the
        folder renamed into place, `latest` moved."""
        markers = {r: m for v in nodes.values() for r, m in v["steps"].get(step, {}).items()}
        if whole := memory.whole_marker(nodes, step):  # a replica's state: its files alone
            markers = {0: whole[1]}
        files = {n: s for m in markers.values() for n, s in m["files"].items()}
        sums = {n: m["sums"][n] for m in markers.values() for n in m["files"]}
        first = markers[0]
        position = Position(step, int(first["samples"]), first.get("stream"))
        write_durably(target / MANIFEST, json.dumps(record(first["manifest"], position, time.time(), files, sums)))
        final = checkpoints / f"step_{step:08d}"
        if not is_remote(checkpoints) and target != final:
            import shutil

            shutil.rmtree(final, ignore_errors=True)  # type: ignore[arg-type]
            os.replace(target, final)  # type: ignore[arg-type]
        write_durably(checkpoints / LATEST, final.name)

    def _tell(self, step: int) -> None:
        """Rank 0, after the first step trained again: the step resumed from, the tier, the steps replayed, and the
        seconds since the failure (the last step time any surviving node recorded)."""
        told, self.resumed = self.resumed, None
        if self.rank != 0 or told is None:
            return
        resumed = step - 1
        last, failed = told["last"] or (resumed, None)
        since = f"; {time.time() - failed:.1f} s from the failure to the first step trained again" if failed else ""
        why = f": {told['why']}" if told["why"] and told["tier"] == "disk" else ""
        print(
            f"launch: resumed from step {resumed} ({told['tier']} tier{why}): {max(0, last - resumed)} step(s) "
            f"replayed{since}",
            flush=True,
        )


@functools.cache
def _planner() -> Any:
    """DCP's planner with its plans cached between the tier's steps (the same state each step), under a name of its
    own (DCP keys its cache by the planner's class)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return type("TierPlanner", (DefaultSavePlanner,), {})


def _read(path: Path) -> torch.Tensor:
    """A file's bytes as a tensor to send, read once."""
    import numpy as np

    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))
