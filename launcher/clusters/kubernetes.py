"""A Kubernetes pod of a multi-node job: a Kubeflow PyTorchJob (or TrainJob) pod, or a JobSet pod. Each pod runs
one `launch`, which starts the pod's workers; the operator says which node the pod is and where the nodes meet.

- PyTorchJob: `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT` (the
  variables torchrun itself reads; `MASTER_ADDR`/`MASTER_PORT` where the `PET_` ones are missing).
- JobSet: `JOBSET_NAME`, `REPLICATED_JOB_NAME`, `JOB_INDEX`, `JOB_COMPLETION_INDEX` (the pod's index, its node rank);
  the first pod is `<jobset>-<replicated job>-<job index>-0.<subdomain>` (the subdomain defaults to the JobSet's
  name: `KUBERNETES_SUBDOMAIN` when it is another), port `rdzv.port` or 29500. A JobSet does not say how many pods
  it has: `nodes=N` on the command line.

Node ranks follow the operator's (the static rendezvous: the pod of rank 0 hosts the store at the master address),
and pods share no POSIX file system unless one is mounted: checkpoints go to `trainer.checkpoint_dir`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from launcher.clusters import Job
from launcher.config import ConfigError, Derived

JOBSET_PORT = 29500
"""The rendezvous port of a JobSet's first pod, where rdzv.port does not say (torchrun's default)."""


def _int(env: Mapping[str, str], key: str) -> int:
    value = env[key]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{key}={value} is not a number of the kind a fixed-size job has; launch runs a fixed number of nodes: "
            "set the job's nodes (a PyTorchJob's elasticPolicy min = max, or none) and nproc per node explicitly"
        ) from None


class PyTorchJob:
    name = "kubernetes"

    def detected(self, env: Mapping[str, str]) -> bool:
        return "PET_NNODES" in env and "PET_NODE_RANK" in env

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        shape = {"nodes": (_int(env, "PET_NNODES"), "PET_NNODES")}
        if env.get("PET_NPROC_PER_NODE", "auto") not in ("auto", "gpu", "cpu"):  # torchrun's words for "by device"
            shape["gpus"] = (_int(env, "PET_NPROC_PER_NODE"), "PET_NPROC_PER_NODE")
        return shape

    def job(self, rdzv: Any, derived: Derived, env: Mapping[str, str]) -> Job:
        host = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
        port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT")
        if not (host and port):
            raise ConfigError(
                "this PyTorchJob pod has PET_NNODES but neither PET_MASTER_ADDR/PET_MASTER_PORT nor MASTER_ADDR/"
                "MASTER_PORT; set rdzv.endpoint=HOST:PORT to the master pod's address"
            )
        return _pod(self.name, derived, _int(env, "PET_NODE_RANK"), f"{host}:{port}")

    def submission(self, argv: Sequence[str]) -> list[str]:
        return []

    def stopped(self, signum: int, previous: Callable[..., Any] | None) -> None:
        pass  # the pod's restart policy decides; the next attempt resumes from trainer.checkpoint_dir


class JobSet:
    name = "kubernetes"

    def detected(self, env: Mapping[str, str]) -> bool:
        return "JOBSET_NAME" in env and "JOB_COMPLETION_INDEX" in env

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        return {}  # how many pods a JobSet has is not in its pods' environment: nodes=N from the command line

    def job(self, rdzv: Any, derived: Derived, env: Mapping[str, str]) -> Job:
        jobset, replicated = env["JOBSET_NAME"], env.get("REPLICATED_JOB_NAME", "")
        subdomain = env.get("KUBERNETES_SUBDOMAIN") or jobset
        first = f"{jobset}-{replicated}-{env.get('JOB_INDEX', '0')}-0.{subdomain}"
        port = rdzv.port if rdzv.port is not None else JOBSET_PORT
        return _pod(self.name, derived, _int(env, "JOB_COMPLETION_INDEX"), f"{first}:{port}")

    def submission(self, argv: Sequence[str]) -> list[str]:
        return []

    def stopped(self, signum: int, previous: Callable[..., Any] | None) -> None:
        pass


def _pod(name: str, derived: Derived, node_rank: int, endpoint: str) -> Job:
    if not 0 <= node_rank < derived.nodes:
        raise ConfigError(
            f"this pod is node {node_rank} of a job of nodes={derived.nodes}; give every pod the same nodes=N"
        )
    if derived.nodes == 1:
        return Job(name, nodes=1, node_rank=0)  # one pod: its rendezvous stays on loopback
    return Job(
        name,
        nodes=derived.nodes,
        node_rank=node_rank,
        endpoint=endpoint,
        run_id=f"k8s-{endpoint.replace(':', '-')}",
        shared_run_dir=False,
        backend="static",
    )


RUN_DIR = "/workspace/run"
"""Each pod's own run directory (metrics and logs on rank 0's pod); checkpoints go to trainer.checkpoint_dir."""


def pytorchjob(
    name: str, image: str, nodes: int, gpus: int, overrides: Sequence[str], device: str, namespace: str | None = None
) -> dict[str, Any]:
    """A Kubeflow PyTorchJob that runs `launch <overrides>` on `nodes` pods of `gpus` workers each: one Master pod
    (node 0) and nodes - 1 Workers, each pod's `launch` taking its node rank and the master's address from the
    operator's PET_* variables (`PyTorchJob.job`)."""
    command = ["launch", *overrides, f"hydra.run.dir={RUN_DIR}"]
    limits = {"nvidia.com/gpu": gpus} if device != "cpu" else {}

    def replicas(count: int) -> dict[str, Any]:
        container = {"name": "pytorch", "image": image, "command": command, "resources": {"limits": limits}}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}

    specs = {"Master": replicas(1)}
    if nodes > 1:
        specs["Worker"] = replicas(nodes - 1)
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {"nprocPerNode": str(gpus), "pytorchReplicaSpecs": specs},
    }
