"""The memory tier from the launcher's side (`launcher.recovery.tier`): this node's folder in shared memory, made for
the workers and removed when the job ends, is stopped or fails for good (its settings are checked before start by
`launcher.recovery.shm.check_memory_tier`)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from launcher.recovery.shm import TIER_ENV, node_folder, tier_on


def memory_tier(resolved: Path, node: str) -> Path | None:
    """This node's folder for the run of `resolved` (None where trainer.memory_checkpoint_every is 0), named in
    `TIER_ENV` for the workers: the node's launcher (`node`) outlives every restart of its worker group."""
    cfg = OmegaConf.load(resolved)
    if not tier_on(cfg.trainer):
        os.environ.pop(TIER_ENV, None)
        return None
    folder = node_folder(str(OmegaConf.select(cfg, "job.run_id", default=None) or "run"), node)
    os.environ[TIER_ENV] = str(folder)
    return folder
