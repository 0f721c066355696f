"""Where the nodes of one job meet: one node binds to loopback; several need a shared endpoint and id,
given by the user or read from the SLURM allocation the job runs in."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from launcher.config import ConfigError, Derived


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str
    run_id: str
    backend: str
    configs: dict[str, Any]


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list: "gpu[01-03,07],cpu1" -> gpu01, gpu02, gpu03, gpu07, cpu1."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def rendezvous(cfg: DictConfig, derived: Derived, env: Mapping[str, str]) -> Rendezvous:
    """Resolve the rendezvous of this job; raise ConfigError on settings that could only stall."""
    r = cfg.rdzv
    if r.backend not in ("c10d", "static"):
        raise ConfigError(f"rdzv.backend={r.backend} is not supported; use c10d or static")
    configs: dict[str, Any] = {"join_timeout": int(r.join_timeout)}
    endpoint, run_id, node_rank = r.endpoint, r.id, r.node_rank
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env:
        slurm_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
        if slurm_nodes != derived.nodes:
            raise ConfigError(
                f"nodes={derived.nodes} but this SLURM allocation has {slurm_nodes} node(s); use nodes={slurm_nodes}"
            )
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
        if tasks and tasks.split("(")[0] != "1":
            raise ConfigError(
                f"SLURM runs {tasks} tasks per node, but each node needs exactly one launcher "
                f"(it starts the gpus={derived.gpus} "
                "workers itself); set hydra.launcher.tasks_per_node=1"
            )
        gpus_on_node = env.get("SLURM_GPUS_ON_NODE")
        if derived.device == "cuda" and gpus_on_node and int(gpus_on_node) < derived.gpus:
            raise ConfigError(
                f"gpus={derived.gpus} but SLURM gave this node {gpus_on_node} GPU(s); "
                f"use gpus={gpus_on_node} or ask SLURM for more"
            )
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        port = r.port if r.port is not None else 20000 + int(re.sub(r"\D", "", env["SLURM_JOB_ID"]) or 0) % 20000
        endpoint = endpoint or f"{hosts[0]}:{port}"
        # A requeued job must not meet the previous attempt's rendezvous.
        run_id = run_id or f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_RESTART_COUNT', '0')}"
        node_rank = node_rank if node_rank is not None else int(env.get("SLURM_NODEID", "0"))
    elif derived.nodes > 1 and not (endpoint and run_id):
        raise ConfigError(
            f"nodes={derived.nodes} needs rdzv.endpoint=HOST:PORT and rdzv.id=NAME, the same on every node "
            "(or run inside a SLURM allocation)"
        )
    if r.backend == "static":
        if derived.nodes > 1 and node_rank is None:
            raise ConfigError("rdzv.backend=static needs rdzv.node_rank=N on each node (or SLURM_NODEID)")
        configs["rank"] = node_rank or 0
    return Rendezvous(endpoint or "127.0.0.1:0", run_id or uuid.uuid4().hex[:12], r.backend, configs)
