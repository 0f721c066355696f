"""Where the nodes of one job meet: one node binds to loopback; several need a shared endpoint and id, given by the
user (rdzv.*) or by the cluster environment the job runs in (`launcher.clusters`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from launcher.clusters import Job, detect, unresolved
from launcher.config import ConfigError, Derived

LOOPBACK = "127.0.0.1"
ETCD = "etcd-v2"
"""torch's etcd rendezvous: its state and its store in an etcd server, which outlives any node of the job."""


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str
    run_id: str
    backend: str
    configs: dict[str, Any]
    local_addr: str | None = None
    """The address the group-rank-0 agent gives the workers as MASTER_ADDR: loopback on one node, so that neither
    the rendezvous nor the process group listens on an external interface."""
    job: Job = Job("local")
    """What the cluster environment said of the job."""


def rendezvous(cfg: DictConfig, derived: Derived, env: Mapping[str, str]) -> Rendezvous:
    """Resolve the rendezvous of this job; raise ConfigError on settings that could only stall."""
    r = cfg.rdzv
    if r.backend not in ("c10d", "static", ETCD):
        raise ConfigError(f"rdzv.backend={r.backend} is not supported; use c10d, static or {ETCD}")
    configs: dict[str, Any] = {"join_timeout": int(r.join_timeout)}
    job = detect(env).job(r, derived, env)
    if job.backend and r.backend == ETCD:  # not replaced in silence by the environment's own
        raise ConfigError(
            f"rdzv.backend={ETCD}: a {job.cluster} job's nodes meet by its own {job.backend} rendezvous, ranks as it "
            "numbers them; leave rdzv.backend out"
        )
    backend = job.backend or r.backend
    endpoint, run_id = r.endpoint or job.endpoint, r.id or job.run_id  # the user's settings win
    node_rank = r.node_rank if r.node_rank is not None else job.node_rank
    if derived.nodes > 1 and not (endpoint and run_id):
        raise ConfigError(
            f"nodes={derived.nodes} needs rdzv.endpoint=HOST:PORT and rdzv.id=NAME, the same on every node "
            "(or run inside a SLURM allocation or a Kubernetes PyTorchJob)"
        )
    if derived.nodes > 1 and r.endpoint and (why := unresolved(r.endpoint)):  # torch's store would retry it a minute
        raise ConfigError(f"rdzv.endpoint={r.endpoint}: {why}; give the first node's address or a name that resolves")
    if backend == ETCD:
        check_etcd(endpoint)
    if derived.min_nodes < derived.nodes:
        if job.cluster != "local":
            raise ConfigError(
                f"nodes={derived.min_nodes}:{derived.nodes} is an elastic range, but a {job.cluster} job has a fixed "
                f"number of nodes; give nodes=N (elastic jobs run on nodes you start by hand)"
            )
        if backend not in ("c10d", ETCD):
            raise ConfigError(
                f"nodes={derived.min_nodes}:{derived.nodes} (elastic) needs the c10d or {ETCD} rendezvous, not "
                f"rdzv.backend={backend}; use rdzv.backend=c10d with rdzv.endpoint and rdzv.id"
            )
        configs["last_call_timeout"] = int(r.last_call_timeout)
    if backend == "static":
        if derived.nodes > 1 and node_rank is None:
            raise ConfigError("rdzv.backend=static needs rdzv.node_rank=N on each node (or SLURM_NODEID)")
        configs["rank"] = node_rank or 0
    if derived.nodes == 1:  # one machine: on loopback (unless told otherwise), a fresh port and id for each launch
        local = None if endpoint else LOOPBACK
        # c10d's agent binds port 0 itself and tells the workers the port it got; the static rendezvous hands its
        # endpoint's port to the workers as MASTER_PORT, so it needs a real one.
        port = _free_port() if backend == "static" else 0
        endpoint, run_id = endpoint or f"{LOOPBACK}:{port}", run_id or uuid.uuid4().hex[:12]
        return Rendezvous(endpoint, run_id, backend, configs, local, job)
    return Rendezvous(endpoint, run_id, backend, configs, job=job)


def check_etcd(endpoint: str | None) -> None:
    """rdzv.backend=etcd-v2 before start: an etcd server that answers the v2 API (the one torch's etcd rendezvous
    speaks) at `endpoint`, and the client torch's backend imports; ConfigError (one line) naming what is missing."""
    import json
    import urllib.error
    import urllib.request

    if not endpoint:
        raise ConfigError(
            f"rdzv.backend={ETCD} needs rdzv.endpoint=HOST:PORT, the client address of an etcd server with its v2 API "
            "on (etcd --enable-v2=true)"
        )
    try:
        import etcd  # noqa: F401  (python-etcd: the client torch's etcd rendezvous imports)
    except ImportError:
        raise ConfigError(
            f"rdzv.backend={ETCD} needs python-etcd, the client torch's etcd rendezvous takes: pip install "
            "'launch[etcd]'"
        ) from None
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy between the nodes and etcd
    try:
        with direct.open(f"http://{endpoint}/v2/keys/", timeout=5) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ConfigError(
                f"rdzv.endpoint={endpoint}: the etcd there has no v2 API, which torch's etcd rendezvous speaks; "
                "start it with --enable-v2=true (etcd 3.4 or 3.5: 3.6 has none)"
            ) from None
        raise ConfigError(
            f"rdzv.endpoint={endpoint}: etcd answered HTTP {e.code} ({e.reason}); check the server"
        ) from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConfigError(
            f"rdzv.endpoint={endpoint}: no etcd answers there ({reason}); start etcd (--enable-v2=true) there, or "
            "give its client address"
        ) from None
    if not (isinstance(body, dict) and "node" in body):
        raise ConfigError(f"rdzv.endpoint={endpoint}: what answers there is not etcd's v2 API; give etcd's address")


def _free_port() -> int:
    """A port on loopback that nothing listens on now (the agent binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class JobFull(Exception):
    """This node joined a job that has all its nodes already (`refuse_spare_nodes`)."""


def refuse_spare_nodes() -> None:
    """torch keeps a node that joins a job with all its nodes (nodes=MIN:MAX running at MAX) as a spare: it waits,
    saying nothing, until a node leaves, for as long as the job runs. The launcher refuses it in one line instead
    (JobFull), before it changes the rendezvous state, and leaves the rendezvous open for the job
    (`launcher.elastic.agent.run_agent`; torch's launcher closes it on its way out: the job's next restart would find
    it closed). Where a member has gone quiet (a node that just failed, started again before torch dropped it), the
    node waits as torch has it, to take that place (`launcher.adapters.torch_private.when_spare`)."""
    from launcher.adapters.torch_private import when_spare

    when_spare(_refuse)


def _refuse(run_id: str, max_nodes: int) -> None:
    raise JobFull(
        f"job {run_id!r} runs on its {max_nodes} nodes already (the most its nodes= allows): this node is not "
        "needed; start it again once a node has left, or start the job with a larger maximum"
    )


def reachable(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether something listens at `endpoint` (HOST:PORT): the rendezvous store of a multi-node job, hosted by the
    agent of one node, is there as long as that node is."""
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
