"""A process that torchrun (or another elastic agent) started as one of its workers: `launch` starts its own
workers and replaces torchrun, so a launch here would run one whole job per worker, each at the wrong scale. It is
refused in one line that shows the command to run instead."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.clusters.local import Local
from launcher.config import ConfigError

PER_PROCESS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")
"""Variables an elastic agent gives each worker process, and no node-level job gives a node."""
NODE_LEVEL = ("PET_NNODES", "SLURM_JOB_ID", "JOBSET_NAME")
"""A job around the process that sets RANK per node (a PyTorchJob pod's RANK is its node's)."""


class Torchrun(Local):
    """Refused in `shape`; the rest is `Local`'s (a submission names no torchrun, and a launch stops before a job)."""

    name = "torchrun"

    def detected(self, env: Mapping[str, str]) -> bool:
        lone_rank = "RANK" in env and not any(key in env for key in NODE_LEVEL)
        return any(key in env for key in PER_PROCESS) or lone_rank

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        given = ", ".join(f"{key}={env[key]}" for key in (*PER_PROCESS, "RANK", "WORLD_SIZE") if key in env)
        world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
        nodes = max(1, world // max(1, local))
        command = f"launch gpus={local}"
        if nodes > 1:
            endpoint = f"{env.get('MASTER_ADDR', 'HOST')}:{env.get('MASTER_PORT', 'PORT')}"
            command = f"launch nodes={nodes} gpus={local} rdzv.endpoint={endpoint} rdzv.id=NAME"
        raise ConfigError(
            f"this process was started by torchrun or another elastic agent ({given}): launch starts its own workers "
            f"and replaces torchrun; run it once per node instead of torchrun: {command} ...your overrides"
        )
