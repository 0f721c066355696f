"""A run's checkpoints from the workers' side: which one every rank resumes from, and one shared directory.

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

from launcher.base.durable import write_durably
from launcher.base.errors import Refused
from launcher.base.storage import checkpoints_of, inside, is_remote, location
from launcher.checkpoint.format import Position, by_time, damage, read_manifest, remove_partial, skipped
from launcher.checkpoint.loading import load
from strategies import RunContext, Strategy

SHARED_CHECK = ".shared-directory"
RUN_DIR_FIX = (
    "the nodes of one run need one shared run directory; set hydra.run.dir to a folder on a file system every node "
    "mounts"
)
CHECKPOINT_DIR_FIX = (
    "the nodes of one run need one checkpoint folder; set trainer.checkpoint_dir to an object-store URL "
    "(s3://bucket/prefix) or to a folder on a file system every node mounts"
)


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_shared_directory(run_dir: Path, ctx: RunContext, fix: str = RUN_DIR_FIX) -> None:
    """Several nodes that share one folder (the run directory, `launcher.clusters.Job.shared_run_dir`, or a local
    checkpoint folder): every rank must see the file rank 0 writes into it; `fix`: what to do where one does not."""
    marker = run_dir / SHARED_CHECK
    nonce = secrets.token_hex(8) if ctx.rank == 0 else None
    if ctx.rank == 0:
        write_durably(marker, nonce)  # type: ignore[arg-type]
    nonce, shared = _broadcast((nonce, str(run_dir)))  # rank 0's path: the one every node names
    try:
        seen = marker.read_text() == nonce
    except OSError:
        seen = False
    views: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(views, (seen, ctx.rank, socket.gethostname()))
    blind = [f"rank {rank} (on {host})" for ok, rank, host in views if not ok]
    if blind:  # every rank has the same views: a refusal told once, not each rank's failure
        more = f" and {len(blind) - 3} more ranks" if len(blind) > 3 else ""
        who = f"{', '.join(blind[:3])}{more} {'do' if len(blind) > 1 else 'does'}"
        raise Refused(f"{who} not see {shared} as rank 0 wrote it: {fix}")


def resume(cfg: DictConfig, ctx: RunContext, strategy: Strategy, run_dir: Path, tier: Any = None) -> Position:
    """Continue from this run's own newest checkpoint (an elastic restart, a requeue), else from `resume=`.

    Rank 0 verifies each candidate's files against their checksums before any rank reads it (`checkpoint.damage`)
    and broadcasts its decision. The run's own newest checkpoint that fails, or does not load, falls back to the one
    before it, with a line naming the checkpoint skipped, the file and why; a checkpoint named by `resume=` (verified
    by the launcher moments ago) does not fall back.
    """
    folder = checkpoints_of(cfg.trainer, run_dir)  # a local folder or a URL
    if tier is not None:  # the newest step complete in the nodes' memory, written here as a checkpoint
        tier.promote(folder)
    paths: list[str] | None = None
    if ctx.rank == 0:
        remove_partial(folder)  # saves that never finished: nobody else writes here (the run's claim)
        given = OmegaConf.select(cfg, "job.resume_from", default=None)
        paths = [str(p) for p in by_time(folder, say=_say)] or ([given] if given else [])
    paths = _broadcast(paths)
    for i, path in enumerate(map(location, paths)):
        manifest: dict[str, Any] | None = None
        if ctx.rank == 0:
            own = inside(path, folder)
            why = damage(path) if own else None
            if why is None:
                manifest = read_manifest(path)
            else:
                _say(skipped(path, why))
        manifest = _broadcast(manifest)
        if manifest is None:
            continue
        try:
            position = load(path, manifest, strategy, ctx.rank, ctx.world_size)
        except BaseException as e:  # DCP's CheckpointException is a BaseException, raised on every rank alike
            if isinstance(e, KeyboardInterrupt) or i == len(paths) - 1 or not inside(path, folder):
                raise
            if ctx.rank == 0:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                _say(skipped(path, f"it does not load ({reason[:200]})"))
            continue
        if ctx.rank == 0:
            attempt = restart_count()
            again = f"restart {attempt} of the worker group: " if attempt else ""
            print(f"launch: {again}resuming from {path} (step {position.step}, sample {position.samples})", flush=True)
            if manifest.get("early_stop"):  # trainer.early_stop ended the run there: it goes on past it now
                stopped = manifest["early_stop"].removeprefix("launch: ")
                print(f"launch: resuming a run that stopped early ({stopped})", flush=True)
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


def _say(line: str) -> None:
    print(line, flush=True)


def check_shared_folders(cfg: DictConfig, ctx: RunContext, run_dir: Path) -> None:
    """The run directory where the cluster shares it (SLURM, nodes by hand), and a local checkpoint folder
    elsewhere (a Kubernetes pod's run directory is its own): every rank sees what rank 0 writes there."""
    shared_run_dir = OmegaConf.select(cfg, "derived.shared_run_dir", default=True)
    if shared_run_dir:
        check_shared_directory(run_dir, ctx)
    where = checkpoints_of(cfg.trainer, run_dir)
    if not is_remote(where) and not (shared_run_dir and inside(where, run_dir)):
        where.mkdir(parents=True, exist_ok=True)
        check_shared_directory(where, ctx, CHECKPOINT_DIR_FIX)
