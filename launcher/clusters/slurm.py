"""A SLURM allocation: one launcher per node (submitted through Hydra's submitit launcher, or run by srun), the
nodes, node rank and first node read from SLURM's variables, the first node reached at the address SLURM records for
it, a requeue on SLURM's time-limit warning."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from launcher.base.machine import ephemeral_port_floor
from launcher.clusters import Job, unresolved
from launcher.config import ConfigError, Derived


class Slurm:
    name = "slurm"

    def detected(self, env: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in env and "SLURM_NNODES" in env

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        return {}

    def job(self, rdzv: Any, derived: Derived, env: Mapping[str, str]) -> Job:
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
        if nodes != derived.nodes:
            raise ConfigError(f"nodes={derived.nodes} but this SLURM allocation has {nodes} node(s); use nodes={nodes}")
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
        if tasks and tasks.split("(")[0] != "1":
            raise ConfigError(
                f"SLURM runs {tasks} tasks per node, but each node needs exactly one launcher (it starts the "
                f"gpus={derived.gpus} workers itself); submit with --ntasks-per-node=1 (through submitit: "
                "hydra.launcher.tasks_per_node=1)"
            )
        gpus_on_node = env.get("SLURM_GPUS_ON_NODE")
        if derived.device == "cuda" and gpus_on_node and int(gpus_on_node) < derived.gpus:
            raise ConfigError(
                f"gpus={derived.gpus} but SLURM gave this node {gpus_on_node} GPU(s); "
                f"use gpus={gpus_on_node} or ask SLURM for more"
            )
        if nodes == 1:
            return Job(self.name, nodes=1, node_rank=0)  # one machine: its rendezvous stays on loopback
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        job = env["SLURM_JOB_ID"]
        port = rdzv.port if rdzv.port is not None else slurm_port(job, rdzv.secret)
        # A requeued job must not meet the previous attempt's rendezvous; the secret (made at submission) keeps
        # another user who knows the job id from meeting it.
        run_id = "-".join(filter(None, ["slurm", job, env.get("SLURM_RESTART_COUNT", "0"), rdzv.secret]))
        node_rank = int(env.get("SLURM_NODEID", "0"))
        if rdzv.endpoint:  # the user's: SLURM's first node is not asked
            return Job(self.name, nodes=nodes, node_rank=node_rank, run_id=run_id)
        address = node_address(hosts[0], env)
        endpoint = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        if why := unresolved(endpoint):
            raise ConfigError(
                f"this SLURM job's first node {hosts[0]} is where its nodes meet, but {why}: give its address with "
                f"rdzv.endpoint=ADDRESS:{port}, or record it in SLURM (NodeAddr= in slurm.conf)"
            )
        return Job(self.name, nodes=nodes, node_rank=node_rank, endpoint=endpoint, run_id=run_id)

    def submission(self, argv: Sequence[str]) -> list[str]:
        return submitit_overrides(argv)

    def stopped(self, signum: int, previous: Callable[..., Any] | None) -> None:
        """submitit's own handler of SLURM's warning signal requeues the job: handed the signal once the checkpoint
        is written, so the next attempt resumes from it. A job SLURM requeued itself (preemption, `scontrol
        requeue`) ends this attempt of a submitit task without a result: submitit's would be the job's, and the
        submission would stop waiting for the attempt that finishes it."""
        if callable(previous):
            previous(signum, None)
        env = os.environ
        if env.get("SUBMITIT_EXECUTOR") == "slurm" and requeued(env):
            print(
                f"launch: SLURM requeues job {env['SLURM_JOB_ID']}: its next attempt resumes from this checkpoint",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signum)  # not an Exception: neither Hydra's job nor submitit records it


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


def node_address(node: str, env: Mapping[str, str]) -> str:
    """The address SLURM records for `node` (its NodeAddr, from `scontrol show node`): a node's name need not resolve
    as a host (nodes named apart from their hostnames, several nodes on one machine). The name itself where scontrol
    is not on `env`'s PATH or says nothing of it."""
    scontrol = shutil.which("scontrol", path=env.get("PATH", ""))
    if scontrol is None:
        return node
    try:
        said = subprocess.run(
            [scontrol, "show", "node", node], env=dict(env), capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    found = re.search(r"\bNodeAddr=(\S+)", said)
    return found.group(1) if found else node


def requeued(env: Mapping[str, str]) -> bool:
    """Whether SLURM starts this job again once this attempt ends: its controller counts more restarts than this
    attempt's SLURM_RESTART_COUNT (a requeue was ordered; a cancel leaves the count as it is)."""
    scontrol = shutil.which("scontrol", path=env.get("PATH", ""))
    if scontrol is None or "SLURM_JOB_ID" not in env:
        return False
    try:
        said = subprocess.run(
            [scontrol, "show", "job", env["SLURM_JOB_ID"]], env=dict(env), capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    found = re.search(r"\bRestarts=(\d+)", said)
    return found is not None and int(found.group(1)) > int(env.get("SLURM_RESTART_COUNT") or 0)


def slurm_port(job_id: str, secret: str | None) -> int:
    """A port for a SLURM job's rendezvous, from its id and secret, below the kernel's ephemeral range (where
    the system hands out ports by itself) and above the well-known ones."""
    low = 10000
    digest = int(hashlib.sha256(f"{job_id}:{secret or ''}".encode()).hexdigest(), 16)
    return low + digest % (ephemeral_port_floor() - low)


SUBMITIT_SLURM = "hydra_plugins.launch_submitit.slurm.SlurmLauncher"
"""Hydra's submitit_slurm launcher that checks the allocation with `sbatch --test-only` before it submits."""
# One elastic agent per node starts the node's workers, so a submitit job has one task per node and asks SLURM for
# `gpus` GPUs per node (none with device=cpu): its shape follows `nodes` and `gpus`, set in one place.
SUBMITIT_SHAPE = {"nodes": "nodes", "gpus_per_node": "gpus", "tasks_per_node": None}


def submitit_overrides(argv: Sequence[str]) -> list[str]:
    """Extra overrides that give a submitit job the run's shape and a rendezvous secret; ValueError if the user set
    a contradicting shape."""
    launcher = [a.split("=", 1)[1] for a in argv if a.startswith("hydra/launcher=")]
    if not launcher or not launcher[-1].startswith("submitit"):
        return []
    given = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith(("-", "+", "~")))
    extra = []
    for key, source in SUBMITIT_SHAPE.items():
        want = "1" if source is None else given.get(source, f"${{{source}}}")
        if key == "gpus_per_node" and given.get("device") == "cpu":
            want = "null"  # gpus= counts CPU workers there: a node without GPUs would be refused them
        have = given.get(f"hydra.launcher.{key}")
        if have is None:
            extra.append(f"hydra.launcher.{key}={want}")
        elif have != want:
            fix = (
                "1: one launcher per node starts the workers" if source is None else f"{want}, or set {source}= instead"
            )
            raise ValueError(f"hydra.launcher.{key}={have} contradicts the run's shape; use hydra.launcher.{key}={fix}")
    if launcher[-1] == "submitit_slurm" and "hydra.launcher._target_" not in given:  # the allocation checked first
        extra.append(f"hydra.launcher._target_={SUBMITIT_SLURM}")
    if "rdzv.secret" not in given:  # made here, at submission: the nodes' rendezvous id and port derive from it
        import secrets

        extra.append(f"rdzv.secret={secrets.token_hex(8)}")
    return extra
