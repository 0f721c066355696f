"""Where a launch runs: local, a SLURM allocation, a Kubernetes pod (PyTorchJob, JobSet), and room for more.

Each cluster environment is a small plugin (a class that follows `Environment`, in a module of this package): it detects
itself from the process environment, says which of the run's keys it dictates (`shape`: a PyTorchJob's nodes and
processes per node), what it knows of the job (its nodes, this node's rank, where the nodes meet) and how the run
directory is shared, checks the launch's settings against it, and says what a submission to it needs and what a stop
signal means there. `detect` takes the first that recognises itself: a process started by torchrun first (where a launch
is refused), `Local` last (it recognises every environment). `launcher.elastic.rendezvous` turns the job into the
elastic agent's rendezvous; the run directory's check (`launcher.checkpoint.resume.check_shared_directory`) reads
`Job.shared_run_dir`.

Add an environment: a module here, and its class in `environments()` before `Local`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from launcher.config import Derived


@dataclass(frozen=True)
class Job:
    """What a cluster environment knows of the job this launch is one node of; None where it knows nothing."""

    cluster: str
    """The environment's name, said in the launch line."""
    nodes: int | None = None
    node_rank: int | None = None
    endpoint: str | None = None
    """HOST:PORT where the nodes meet (the first node's agent listens there)."""
    run_id: str | None = None
    """The rendezvous id every node of this job, and of this attempt of it, shares."""
    shared_run_dir: bool = True
    """The nodes write into one run directory on a file system each of them mounts: rank 0's view of it must be every
    rank's (checked before the first save)."""
    backend: str | None = None
    """The rendezvous backend the environment needs (static: node ranks as it numbers them); None: rdzv.backend."""


class Environment(Protocol):
    name: str

    def detected(self, env: Mapping[str, str]) -> bool:
        """Whether this process runs inside this environment."""
        ...

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        """The run's keys (`nodes`, `gpus`) the environment dictates: key -> (value, the variable that says it);
        ConfigError (one line) where it forbids a launch."""
        ...

    def job(self, rdzv: Any, derived: Derived, env: Mapping[str, str]) -> Job:
        """What the environment says of the job; ConfigError (one line, naming both) where the launch's settings
        (`nodes`, `gpus`, `rdzv.*`) contradict it."""
        ...

    def submission(self, argv: Sequence[str]) -> list[str]:
        """Overrides a submission to this environment through a Hydra launcher plugin adds to `argv` (none when
        `argv` submits elsewhere); ValueError (one line) for a shape that contradicts the run's."""
        ...

    def stopped(self, signum: int, previous: Callable[..., Any] | None) -> None:
        """The workers saved and stopped on `signum`: what the environment does next (`previous`: the handler that
        was there before the launcher's)."""
        ...


def environments() -> tuple[Environment, ...]:
    from launcher.clusters.kubernetes import JobSet, PyTorchJob
    from launcher.clusters.local import Local
    from launcher.clusters.slurm import Slurm
    from launcher.clusters.torchrun import Torchrun

    return (Torchrun(), PyTorchJob(), JobSet(), Slurm(), Local())


def detect(env: Mapping[str, str]) -> Environment:
    """The environment this process runs in: the first of `environments()` that recognises itself."""
    return next(e for e in environments() if e.detected(env))


def submission(argv: Sequence[str]) -> list[str]:
    """The overrides a submission through a Hydra launcher plugin needs (e.g. hydra/launcher=submitit_slurm)."""
    return [extra for e in environments() for extra in e.submission(argv)]


def unresolved(endpoint: str) -> str | None:
    """Why the host of `endpoint` (HOST:PORT, [V6]:PORT) has no address here (one clause), or None where it has one:
    said at the start, where torch's store would retry a name that never resolves for a minute."""
    import socket

    host = endpoint[1 : endpoint.find("]")] if endpoint.startswith("[") else endpoint.rsplit(":", 1)[0]
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return f"the host {host} of {endpoint} has no address here ({getattr(e, 'strerror', None) or e})"
    return None


def shaped(cfg: Any, env: Mapping[str, str], given: Sequence[str]) -> Any:
    """The frozen config with the keys the environment dictates (`Environment.shape`) set from it; ConfigError naming
    both where the command line (`given`: the job's overrides) said another value."""
    from launcher.config import ConfigError

    environment = detect(env)
    for key, (value, variable) in environment.shape(env).items():
        said = [o.split("=", 1)[1] for o in given if o.split("=", 1)[0] == key]
        if said and said[-1] != str(value):
            raise ConfigError(
                f"{key}={said[-1]} on the command line, but this {environment.name} job's {variable}={value}; "
                f"drop {key}= (it is taken from {variable}) or make them agree"
            )
        cfg[key] = value
    return cfg
