"""A run's checkpoints from the workers' side: where to resume, what a save records, and one shared directory.

Collective on purpose: rank 0 decides (which checkpoint, whether the directory is shared) and every rank follows
its decision, so a stale view of a shared file system on one node can never split the ranks across steps.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launcher import checkpoint
from launcher.checkpoint import Position
from launcher.config import sweep_identity
from launcher.durable import write_durably
from launcher.saving import Saver, check_space, checkpoint_bytes
from launcher.untrusted import read_manifest
from strategies import RunContext, Strategy

SHARED_CHECK = ".shared-directory"


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_shared_directory(run_dir: Path, ctx: RunContext, nodes: int) -> None:
    """Several nodes: every rank must see the file rank 0 writes into the run directory, before the first save."""
    if nodes == 1:
        return  # one machine, one file system
    marker = run_dir / SHARED_CHECK
    nonce = secrets.token_hex(8) if ctx.rank == 0 else None
    if ctx.rank == 0:
        write_durably(marker, nonce)  # type: ignore[arg-type]
    nonce = _broadcast(nonce)
    try:
        seen = marker.read_text() == nonce
    except OSError:
        seen = False
    views: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(views, (seen, ctx.rank, socket.gethostname()))
    blind = [(rank, host) for ok, rank, host in views if not ok]
    if blind:
        rank, host = blind[0]
        raise RuntimeError(
            f"rank {rank} (on {host}) does not see {run_dir} as rank 0 wrote it: the nodes of one run need one "
            "shared run directory; set hydra.run.dir to a folder on a file system every node mounts"
        )


def resume(cfg: DictConfig, ctx: RunContext, strategy: Strategy, run_dir: Path) -> Position:
    """Continue from this run's own newest checkpoint (an elastic restart, a requeue), else from `resume=`.

    Rank 0 verifies each candidate's files against their checksums before any rank reads it (`checkpoint.damage`)
    and broadcasts its decision. The run's own newest checkpoint that fails, or does not load, falls back to the one
    before it, with a line naming the checkpoint skipped, the file and why; a checkpoint named by `resume=` (verified
    by the launcher moments ago) does not fall back.
    """
    folder = run_dir / "checkpoints"
    paths: list[str] | None = None
    if ctx.rank == 0:
        checkpoint.remove_partial(folder)  # saves that never finished: nobody else writes here (the run's claim)
        given = OmegaConf.select(cfg, "job.resume_from", default=None)
        ordered = checkpoint.by_time(folder)
        for broken in sorted(set(folder.glob("step_*")) - set(ordered)):
            print(checkpoint.skipped(broken, checkpoint.damage(broken) or "its manifest does not parse"), flush=True)
        paths = [str(p) for p in ordered] or ([given] if given else [])
    paths = _broadcast(paths)
    for i, path in enumerate(map(Path, paths)):
        manifest: dict[str, Any] | None = None
        if ctx.rank == 0:
            own = path.is_relative_to(folder)
            why = checkpoint.damage(path) if own else None
            if why is None:
                manifest = read_manifest(path)
            else:
                print(checkpoint.skipped(path, why), flush=True)
        manifest = _broadcast(manifest)
        if manifest is None:
            continue
        try:
            position = checkpoint.load(path, manifest, strategy, ctx.rank, ctx.world_size)
        except BaseException as e:  # DCP's CheckpointException is a BaseException, raised on every rank alike
            if isinstance(e, KeyboardInterrupt) or i == len(paths) - 1 or not path.is_relative_to(folder):
                raise
            if ctx.rank == 0:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                print(checkpoint.skipped(path, f"it does not load ({reason[:200]})"), flush=True)
            continue
        if ctx.rank == 0:
            attempt = restart_count()
            again = f"restart {attempt} of the worker group: " if attempt else ""
            print(f"launch: {again}resuming from {path} (step {position.step}, sample {position.samples})", flush=True)
        return position
    if paths:
        raise RuntimeError(
            f"none of the {len(paths)} checkpoint(s) in {folder} verifies (the lines above say why); move them away "
            "to start this run afresh"
        )
    return Position(step=0, samples=0)


def restart_count() -> int:
    """How often the elastic agent has restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def saver(cfg: DictConfig, ctx: RunContext, run_dir: Path, strategy: Strategy, position: Position) -> Saver:
    """This run's saves: synchronous, or asynchronous under trainer.async_checkpoint; collective: the room for as many
    checkpoints as the run will hold at once (`held_at_once`) is checked first."""
    trainer = cfg.trainer
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    held = _broadcast(len(checkpoint.complete(folder)) if ctx.rank == 0 else None)
    count = held_at_once(trainer, position.step, held)
    if count:
        keep = f"trainer.keep_last={trainer.keep_last}" if trainer.keep_last > 0 else "trainer.keep_last=0: all kept"
        what = f"the {count} checkpoint(s) this run holds at once ({keep}, {held} saved before)"
        check_space(folder, checkpoint_bytes(strategy.state_dict(), ctx.world_size), count, what)
    return Saver(
        run_dir / "checkpoints",
        ctx.rank,
        ctx.world_size,
        trainer.keep_last,
        asynchronous=bool(trainer.get("async_checkpoint", False)),
        timeout=float(trainer.collective_timeout),
        pinned=ctx.device_type == "cuda",
    )


def held_at_once(trainer: DictConfig, step: int, held: int) -> int:
    """How many more checkpoints the run's folder holds at its fullest, beside the `held` already there, when the run
    goes on from `step`: its saves until trainer.max_steps, up to trainer.keep_last plus the one being written (the
    oldest is pruned once the new one is complete)."""
    every = int(trainer.checkpoint_every)
    saves = {s for s in range(step + 1, trainer.max_steps + 1) if every > 0 and s % every == 0}
    saves |= {trainer.max_steps} if trainer.save_at_end and trainer.max_steps > step else set()
    if trainer.keep_last <= 0:
        return len(saves)
    return max(0, min(len(saves), trainer.keep_last + 1 - held))


def manifest_of(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run, beside its step and files."""
    job = cfg.job
    return {
        "strategy": OmegaConf.select(cfg, "job.choices.strategy", default=None) or cfg.strategy._target_,
        "world_size": ctx.world_size,
        "precision": ctx.precision,
        "config_hash": job.config_hash,
        "overrides": sweep_identity(job.overrides) if job.get("sweep_dir") else None,
    }
