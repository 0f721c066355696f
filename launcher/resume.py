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
from launcher.saving import Saver
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

    Rank 0 lists the candidates and broadcasts them. The run's own newest checkpoint that does not load falls back
    to the one before it, with a line saying so; a checkpoint named by `resume=` does not fall back.
    """
    folder = run_dir / "checkpoints"
    candidates: list[tuple[str, dict[str, Any]]] | None = None
    if ctx.rank == 0:
        checkpoint.remove_partial(folder)  # saves that never finished: nobody else writes here (the run's claim)
        given = OmegaConf.select(cfg, "job.resume_from", default=None)
        paths = checkpoint.complete(folder) or ([Path(given)] if given else [])
        candidates = [(str(p), read_manifest(p)) for p in paths]
    chosen = [(Path(p), manifest) for p, manifest in _broadcast(candidates)]
    paths = [p for p, _ in chosen]
    for i, (path, manifest) in enumerate(chosen):
        try:
            position = checkpoint.load(path, manifest, strategy, ctx.rank, ctx.world_size)
        except BaseException as e:  # DCP's CheckpointException is a BaseException, raised on every rank alike
            if isinstance(e, KeyboardInterrupt) or i == len(paths) - 1 or not path.is_relative_to(folder):
                raise
            if ctx.rank == 0:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                print(f"launch: {path} does not load ({reason[:200]}); falling back to {paths[i + 1]}", flush=True)
            continue
        if ctx.rank == 0:
            attempt = restart_count()
            why = f"restart {attempt} of the worker group: " if attempt else ""
            print(f"launch: {why}resuming from {path} (step {position.step}, sample {position.samples})", flush=True)
        return position
    return Position(step=0, samples=0)


def restart_count() -> int:
    """How often the elastic agent has restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def saver(cfg: DictConfig, ctx: RunContext, run_dir: Path) -> Saver:
    """This run's saves: synchronous, or asynchronous under trainer.async_checkpoint."""
    trainer = cfg.trainer
    return Saver(
        run_dir / "checkpoints",
        ctx.rank,
        ctx.world_size,
        trainer.keep_last,
        asynchronous=bool(trainer.get("async_checkpoint", False)),
        timeout=float(trainer.collective_timeout),
        pinned=ctx.device_type == "cuda",
    )


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
