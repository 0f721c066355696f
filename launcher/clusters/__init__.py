"""Where a launch runs: local, a SLURM allocation, and room for more.

Each cluster environment is a small plugin (a class that follows `Environment`, in a module of this package): it
detects itself from the process environment, says what it knows of the job (its nodes, this node's rank, where the
nodes meet) and how the run directory is shared, checks the launch's settings against it, and says what a
submission to it needs and what a stop signal means there. `detect` takes the first that recognises itself; `Local`
recognises every environment, so it comes last. `launcher.rendezvous` turns the job into the elastic agent's
rendezvous; the run directory's check (`launcher.resume.check_shared_directory`) reads `Job.shared_run_dir`.

Add an environment: a module here, and its class in `ENVIRONMENTS` before `Local`.
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


class Environment(Protocol):
    name: str

    def detected(self, env: Mapping[str, str]) -> bool:
        """Whether this process runs inside this environment."""
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
    from launcher.clusters.local import Local
    from launcher.clusters.slurm import Slurm

    return (Slurm(), Local())


def detect(env: Mapping[str, str]) -> Environment:
    """The environment this process runs in: the first of `environments()` that recognises itself."""
    return next(e for e in environments() if e.detected(env))


def submission(argv: Sequence[str]) -> list[str]:
    """The overrides a submission through a Hydra launcher plugin needs (e.g. hydra/launcher=submitit_slurm)."""
    return [extra for e in environments() for extra in e.submission(argv)]
