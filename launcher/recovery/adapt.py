"""Runs that adapt to their resources without changing their result: a micro-batch that follows memory
(`batch.micro_size=auto`) and a world size that follows the nodes (`nodes=MIN:MAX`).

Both lean on the batch contract: the samples of step s depend only on the seed and the global batch, and the loss is
normalised over the global batch's targets, so micro x accumulation x world size may change between two attempts of
a worker group while the trajectory does not. What changes is decided before start where it can be (the planner's
micro-batch, every world size of the range checked against the global batch) and at a restart of the worker group
where it cannot (an out-of-memory error, a node that left or joined): never inside a step.

The micro-batch a run adapted to after an out-of-memory error is kept in `<run dir>/adapted.json`, which every later
attempt (an elastic restart, a resize, a requeue, a `resume=` of the same run) starts from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from launcher.base.run_files import RESIZING
from launcher.config import ConfigError, Derived, valid_micro_sizes, world_sizes

ADAPTED = "adapted.json"


def smaller(micro: int, valid: list[int]) -> int | None:
    """The size after an out-of-memory error at `micro`: half of it, or the largest valid size below half, or the
    largest valid size below `micro`; None when there is none (micro 1)."""
    below = [m for m in valid if m < micro]
    return next((m for m in below if m <= micro // 2), below[0] if below else None)


def read_adapted(run_dir: Path) -> int | None:
    """The micro-batch this run adapted to, or None. The file is data: anything but its one positive integer is
    refused, in one line naming it (and one the job never runs at by the planner, `launcher.plan.commands.choose_micro`:
    `smaller` never writes another)."""
    path = run_dir / ADAPTED
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); remove it to plan the micro-batch afresh") from e
    micro = record.get("micro_size") if isinstance(record, dict) else None
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ConfigError(f"{path} holds no positive micro_size; remove it to plan the micro-batch afresh")
    return micro


def write_adapted(run_dir: Path, record: dict[str, Any]) -> None:
    """Atomically: two ranks that ran out of memory at once write the same record."""
    tmp = run_dir / f".{ADAPTED}.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, run_dir / ADAPTED)


def oom_restarts(frozen: Any, derived: Derived) -> int:
    """How many times batch.micro_size=auto can still halve its micro-batch: the restarts the elastic agent must allow
    beyond the user's trainer.max_restarts (an out-of-memory restart is not a failure the user budgeted for)."""
    if not derived.micro_auto:
        return 0
    worlds = world_sizes(f"{derived.min_nodes}:{derived.nodes}", derived.gpus)
    valid, micro, count = valid_micro_sizes(int(frozen.batch.global_size), worlds), int(frozen.batch.micro_size), 0
    while (micro := smaller(micro, valid) or 0) > 0:
        count += 1
    return count


def agreed_micro(cfg: Any, rank: int, run_dir: Path, device: Any) -> int:
    """The micro-batch this attempt of the worker group runs at: the planned one, or the smaller one an out-of-memory
    error left in `<run dir>/adapted.json`. The ranks take the smallest any of them read (one all-reduce, only under
    batch.micro_size=auto): nodes that do not share the run directory agree too."""
    planned = int(cfg.batch.micro_size)
    if not cfg.derived.get("micro_auto"):
        return planned
    import torch
    import torch.distributed as dist

    try:
        mine = min(planned, read_adapted(run_dir) or planned)
    except ConfigError:
        mine = planned  # the launcher read it moments ago: a rank that cannot read it now defers to the others
    agreed = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def say_batch(cfg: Any, micro: int, world_size: int, run_dir: Path) -> None:
    """Rank 0's line when this attempt's micro-batch or world size is not the planned one: what it runs at, and why."""
    derived, planned = cfg.derived, int(cfg.batch.micro_size)
    if micro == planned and world_size == int(derived.world_size):
        return
    accumulation = int(cfg.batch.global_size) // (micro * world_size)
    why = []
    if micro != planned:
        try:
            record = json.loads((run_dir / ADAPTED).read_text())
            why.append(f"rank {int(record['rank'])} ran out of memory at micro-batch {int(record['after'])}")
        except (OSError, ValueError, KeyError, TypeError):
            why.append("an out-of-memory error halved it")
    if world_size != int(derived.world_size):
        why.append(f"{world_size // int(derived.gpus)} of up to {derived.nodes} nodes are in the group")
    print(
        f"launch: micro-batch {micro} x accumulation {accumulation} x world size {world_size} = global "
        f"{cfg.batch.global_size} ({'; '.join(why)}): the same samples and loss per step",
        flush=True,
    )


def after_out_of_memory(cfg: Any, ctx: Any, run_dir: Path, phase: str) -> bool:
    """An out-of-memory error in forward or backward under batch.micro_size=auto: record the next smaller micro-batch
    for the restarted worker group (the elastic agent restarts it: no in-process recovery of sharded state, which
    can hang) and say so; False where a smaller micro-batch cannot help (another phase, micro-batch 1, a fixed
    micro-batch), and the error stays the run's failure."""
    if not cfg.derived.get("micro_auto") or not phase.startswith("in forward/backward"):
        return False
    worlds = world_sizes(f"{cfg.derived.min_nodes}:{cfg.derived.nodes}", int(cfg.derived.gpus))
    smaller_size = smaller(ctx.micro_size, valid_micro_sizes(int(cfg.batch.global_size), worlds))
    if smaller_size is None:
        return False
    write_adapted(run_dir, {"micro_size": smaller_size, "after": ctx.micro_size, "rank": ctx.rank, "phase": phase})
    print(
        f"launch: rank {ctx.rank} ran out of memory {phase} at micro-batch {ctx.micro_size}; the worker group restarts "
        f"at micro-batch {smaller_size} x accumulation "
        f"{int(cfg.batch.global_size) // (smaller_size * ctx.world_size)} (batch.micro_size=auto) from the newest "
        "checkpoint",
        flush=True,
    )
    return True


def resizing(run_dir: Path, since: float) -> bool:
    """Whether the stop signal this worker got (after `since`, its start) is the agent's resize of the group."""
    try:
        return (run_dir / RESIZING).stat().st_mtime >= since
    except OSError:
        return False
