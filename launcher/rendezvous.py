"""Where the nodes of one job meet: one node binds to loopback; several need a shared endpoint and id,
given by the user or read from the SLURM allocation the job runs in."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from launcher.config import ConfigError, Derived
from launcher.machine import ephemeral_port_floor

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str
    run_id: str
    backend: str
    configs: dict[str, Any]
    local_addr: str | None = None
    """The address the group-rank-0 agent gives the workers as MASTER_ADDR: loopback on one node, so that neither
    the rendezvous nor the process group listens on an external interface."""


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list, in SLURM's order: "gpu[01-03,07],cpu1" -> gpu01, gpu02, gpu03, gpu07, cpu1;
    "r[1-2]n[01-02]" -> r1n01, r1n02, r2n01, r2n02; "node[1-2]-ib" -> node1-ib, node2-ib."""
    hosts: list[str] = []
    for expression in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):  # commas inside brackets do not split
        names = [""]
        for part in re.split(r"(\[[^\]]*\])", expression):
            options = [part]
            if part.startswith("["):
                options = []
                for span in part[1:-1].split(","):
                    lo, _, hi = span.partition("-")
                    options += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
            names = [name + option for name in names for option in options]
        hosts += names
    return hosts


def slurm_port(job_id: str, secret: str | None) -> int:
    """A port for a SLURM job's rendezvous, from its id and secret, below the kernel's ephemeral range (where
    the system hands out ports by itself) and above the well-known ones."""
    low = 10000
    digest = int(hashlib.sha256(f"{job_id}:{secret or ''}".encode()).hexdigest(), 16)
    return low + digest % (ephemeral_port_floor() - low)


def rendezvous(cfg: DictConfig, derived: Derived, env: Mapping[str, str]) -> Rendezvous:
    """Resolve the rendezvous of this job; raise ConfigError on settings that could only stall."""
    r = cfg.rdzv
    if r.backend not in ("c10d", "static"):
        raise ConfigError(f"rdzv.backend={r.backend} is not supported; use c10d or static")
    configs: dict[str, Any] = {"join_timeout": int(r.join_timeout)}
    endpoint, run_id, node_rank = r.endpoint, r.id, r.node_rank
    in_slurm = "SLURM_JOB_ID" in env and "SLURM_NNODES" in env
    if in_slurm:
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
    if in_slurm and derived.nodes > 1:
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        job = env["SLURM_JOB_ID"]
        endpoint = endpoint or f"{hosts[0]}:{r.port if r.port is not None else slurm_port(job, r.secret)}"
        # A requeued job must not meet the previous attempt's rendezvous; the secret (made at submission) keeps
        # another user who knows the job id from meeting it.
        run_id = run_id or "-".join(filter(None, ["slurm", job, env.get("SLURM_RESTART_COUNT", "0"), r.secret]))
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
    if derived.nodes == 1:  # one machine: on loopback (unless told otherwise), a fresh port and id for each launch
        local = None if endpoint else LOOPBACK
        # c10d's agent binds port 0 itself and tells the workers the port it got; the static rendezvous hands its
        # endpoint's port to the workers as MASTER_PORT, so it needs a real one.
        port = _free_port() if r.backend == "static" else 0
        return Rendezvous(endpoint or f"{LOOPBACK}:{port}", run_id or uuid.uuid4().hex[:12], r.backend, configs, local)
    return Rendezvous(endpoint, run_id, r.backend, configs)


def _free_port() -> int:
    """A port on loopback that nothing listens on now (the agent binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
