"""The memory tier from the launcher's side (`launcher.worker.tier`): this node's folder in shared memory, made for
the workers and removed when the job ends, is stopped or fails for good; and its settings, checked before start."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher.checkpoint.memory import SHM, TIER_ENV, node_folder, tier_bytes
from launcher.config import ConfigError


def memory_tier(resolved: Path, node: str) -> Path | None:
    """This node's folder for the run of `resolved` (None where trainer.memory_checkpoint_every is 0), named in
    `TIER_ENV` for the workers: the node's launcher (`node`) outlives every restart of its worker group."""
    cfg = OmegaConf.load(resolved)
    if not int(OmegaConf.select(cfg, "trainer.memory_checkpoint_every", default=0) or 0):
        os.environ.pop(TIER_ENV, None)
        return None
    folder = node_folder(str(OmegaConf.select(cfg, "job.run_id", default=None) or "run"), node)
    os.environ[TIER_ENV] = str(folder)
    return folder


def replicas(trainer: DictConfig, nodes: int) -> int:
    """trainer.memory_replicas, or its default: 1 on a multi-node job, 0 on one node."""
    wanted = trainer.get("memory_replicas")
    return int(wanted) if wanted is not None else (1 if nodes > 1 else 0)


def check_memory_tier(trainer: DictConfig, nodes: int, min_nodes: int, job_bytes: int | None) -> None:
    """The memory tier's settings against the job: replicas it has nodes for, and room in shared memory for two
    steps of a node's share of the job's state (`job_bytes`, if known) and its replicas', both at its fewest nodes."""
    if not int(trainer.get("memory_checkpoint_every", 0) or 0):
        return
    count = replicas(trainer, nodes)
    if count and nodes == 1:
        raise ConfigError(
            f"trainer.memory_replicas={count} on a single-node job: replicas go to other nodes; set "
            "trainer.memory_replicas=0 (the tier then survives a failed rank, not a lost node)"
        )
    if count >= min_nodes:
        fewest = f"nodes={min_nodes}:{nodes} may run on {min_nodes}" if min_nodes < nodes else f"nodes={nodes}"
        raise ConfigError(
            f"trainer.memory_replicas={count} needs more than {count} nodes, but {fewest}; set "
            f"trainer.memory_replicas to at most {min_nodes - 1}"
        )
    if job_bytes is None or not SHM.is_dir():
        return
    stat = os.statvfs(SHM)
    free, need = stat.f_bavail * stat.f_frsize, tier_bytes(job_bytes, count, min_nodes)
    if need > free:
        raise ConfigError(
            f"the memory tier needs {need / 1e6:.1f} MB of shared memory on each node (2 steps x "
            f"{job_bytes / 1e6:.1f} MB of state / {min_nodes} node(s) x (1 + {count} replica(s))), but {SHM} has "
            f"{free / 1e6:.1f} MB free; enlarge {SHM}, lower trainer.memory_replicas, or set "
            "trainer.memory_checkpoint_every=0"
        )
