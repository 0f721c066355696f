"""Replicas are the copy: under a strategy whose every rank holds the whole state (ddp), the memory tier makes no
per-step copy of its own. Each step it notes only which step the rank's state is (a counter, no bytes moved). When
the job fails (a peer's collective broke, a collective timed out, a stop for a restart), each rank that survives
writes the state it holds, once, into its node's folder in shared memory, without a collective (the group is broken):
the first of a node's ranks to claim the step writes it. A restart promotes it as any step of the tier
(`launcher.recovery.tier.MemoryTier.promote`): one surviving node is enough, and the job resumes from the last step
complete, none replayed.

The state is written only where it is that of the step the rank last completed: torch's optimizer step hooks count
the updates, and a failure between an update and the step's end (or during one) writes nothing; the restart then
takes the disk tier, said in one line.
"""

from __future__ import annotations

import io
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from launcher.base.hashing import xxh3
from launcher.checkpoint.format import Position, rng_name
from launcher.recovery import shm as memory


def holds_whole_state(layout: Any) -> bool:
    """Whether every rank of a strategy of this `Layout` holds the whole model and optimizer state (ddp): a surviving
    rank is a replica of every lost one."""
    sharded = layout.params.sharded or layout.grads.sharded or layout.optimizer.sharded
    return not sharded and layout.mesh.tensor_size == 1


class Replica:
    """This rank's state as the tier's copy: which step it is, and its write on a failure."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.updates = 0
        """Optimizer steps applied since the start of this worker (torch's step hooks)."""
        self.updating = False
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)
        self.position: Position | None = None
        self.at = -1
        """`updates` when the step at `position` ended: the state is that step's while they are equal."""
        self.rng: dict[str, Any] = {}
        """The generators' states when the step at `position` ended (a few KB, kept as tensors)."""

    @classmethod
    def of(cls, strategy: Any) -> Replica | None:
        """A replica of the whole state where `strategy` holds it on every rank, with a torch optimizer to count."""
        optimizer = getattr(strategy, "optimizer", None)
        if not holds_whole_state(strategy.layout()) or not isinstance(optimizer, torch.optim.Optimizer):
            return None
        return cls(optimizer)

    def _before(self, *_: Any) -> None:
        self.updating = True

    def _after(self, *_: Any) -> None:
        self.updating, self.updates = False, self.updates + 1

    def ended(self, position: Position, rng: dict[str, Any]) -> None:
        """Step `position.step` ended: the state is its own until the next update."""
        self.position, self.at, self.rng = position, self.updates, rng

    def write(self, folder: Path, strategy: Any, rank: int, world: int, manifest: dict[str, Any]) -> str:
        """On a failure: this rank's state into its node's folder, as the step it last completed, where it is that
        step's and no rank of this node claimed it first; what was done, in words (for the rank's log)."""
        position = self.position
        if position is None:
            return "no step complete yet: nothing written"
        if self.updating or self.updates != self.at:
            return f"the state is past step {position.step} (an optimizer update under way or done): nothing written"
        import torch.distributed.checkpoint as dcp

        from launcher.checkpoint.hashing import hashing_writer

        step = memory.step_folder(folder, position.step)
        try:
            step.mkdir(parents=True)  # the claim: one rank of the node writes
        except FileExistsError:
            return f"step {position.step} claimed by another rank of this node"
        sums: dict[str, str] = {}
        with warnings.catch_warnings():  # DCP says it assumes one process: that is what no_dist asks of it
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(strategy.state_dict(), storage_writer=hashing_writer(step, sums), no_dist=True)
        rng = io.BytesIO()
        torch.save(self.rng, rng)
        sums[rng_name(rank)] = xxh3(rng.getvalue())
        (step / rng_name(rank)).write_bytes(rng.getvalue())
        sizes = {name: (step / name).stat().st_size for name in sums}
        stream = {"stream": position.stream} if position.stream is not None else {}
        marker = {
            "rank": rank,
            "step": position.step,
            "world_size": world,
            "node": str(folder),
            "time": time.time(),
            "files": sizes,
            "sums": sums,
            "whole": True,
            "samples": position.samples,
            **stream,
            "manifest": manifest,
        }
        memory.put(folder, position.step, {}, marker)
        return f"step {position.step} written, {sum(sizes.values()) / 1e6:.1f} MB"
