"""When a run saves and how many checkpoints it holds: the save policy (trainer.checkpoint_every, save_at_end,
keep_last, async_checkpoint), and the saver it makes, once the room for what it will hold is checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.storage import checkpoints_of, is_remote
from launcher.checkpoint.format import complete
from launcher.checkpoint.saving import Saver
from launcher.checkpoint.space import check_space, checkpoint_bytes


@dataclass(frozen=True)
class SavePolicy:
    every: int
    """trainer.checkpoint_every: a save every this many steps (0: none but the last and a stop's)."""
    at_end: bool
    """trainer.save_at_end: the last step is saved."""
    max_steps: int
    keep_last: int
    """The newest this many complete checkpoints are kept (0: all)."""

    @classmethod
    def of(cls, trainer: Any) -> SavePolicy:
        every, at_end, steps = int(trainer.checkpoint_every), bool(trainer.save_at_end), int(trainer.max_steps)
        return cls(every, at_end, steps, int(trainer.keep_last))

    def due(self, step: int, stopping: bool) -> bool:
        """Whether the checkpoint of `step` is saved: on a stop (every rank agreed on it), every `every` steps, and at
        the end."""
        return stopping or (self.every > 0 and step % self.every == 0) or (self.at_end and step == self.max_steps)

    def held_at_once(self, step: int, held: int) -> int:
        """How many more checkpoints the run's folder holds at its fullest, beside the `held` already there, when the
        run goes on from `step`: its saves until max_steps, up to keep_last plus the one being written (the oldest is
        pruned once the new one is complete)."""
        saves = sum(self.due(s, False) for s in range(step + 1, self.max_steps + 1))
        if self.keep_last <= 0:
            return saves
        return max(0, min(saves, self.keep_last + 1 - held))


def saver(cfg: Any, ctx: Any, run_dir: Path, strategy: Any, step: int) -> Saver:
    """This run's saves, going on from `step`: synchronous, or asynchronous under trainer.async_checkpoint.
    Collective: the room for as many checkpoints as the run will hold at once (`held_at_once`) is checked first."""
    import torch.distributed as dist

    trainer, policy = cfg.trainer, SavePolicy.of(cfg.trainer)
    folder = checkpoints_of(trainer, run_dir)  # a local folder or a URL
    folder.mkdir(parents=True, exist_ok=True)
    box = [len(complete(folder)) if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    held = int(box[0])  # type: ignore[arg-type]
    count = policy.held_at_once(step, held)
    if count and not is_remote(folder):  # object storage has no free space to check
        keep = f"trainer.keep_last={policy.keep_last}" if policy.keep_last > 0 else "trainer.keep_last=0: all kept"
        what = f"the {count} checkpoint(s) this run holds at once ({keep}, {held} saved before)"
        try:
            check_space(folder, checkpoint_bytes(strategy.state_dict(), ctx.world_size), count, what)
        except RuntimeError as e:  # every rank read rank 0's free space: one refusal, not a failure per rank
            from launcher.base.errors import Refused

            raise Refused(f"the check for room before the first save: {e}") from e
    return Saver(
        folder,
        ctx.rank,
        ctx.world_size,
        policy.keep_last,
        asynchronous=bool(trainer.get("async_checkpoint", False)),
        timeout=float(trainer.collective_timeout),
        pinned=ctx.device_type == "cuda",
    )
