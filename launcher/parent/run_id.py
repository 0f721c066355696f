"""One logger run per job: its id, made once per run directory, and the run a `resume=` into a new directory continues.

`<run dir>/run_id` holds the id (one line). Every launch of the directory reads it: an elastic restart, a resize, a
SLURM requeue and `resume=<run dir>` all continue one wandb run (`launcher.loggers.wandb.WandbLogger`). Nodes that share
no run directory derive it from what their job shares instead (`derived_run_id`). The parent records it in resolved.yaml
as `job.run_id`, the workers in each checkpoint's manifest; a `resume=` of a checkpoint whose manifest names another run
id records that one as `job.continues`: the new run names the one it continues.

The file is made race-free (the launchers of several nodes prepare one shared run directory at once): created with
O_CREAT|O_EXCL, and a launcher that finds it already there reads the id the first one wrote. What is in it is
untrusted: one that is not an id is refused in one line, never replaced, since a new id would silently split the
run's history in two.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import string
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from launcher.checkpoint.format import RUN_ID_PATTERN
from launcher.config import ConfigError

if TYPE_CHECKING:
    from launcher.base.storage import Location
    from launcher.parent.rundir import Ownership

RUN_ID = "run_id"
WRITE_WAIT = 5.0
"""Seconds a launcher waits for another to finish writing the id file it created a moment ago."""


def new_id() -> str:
    """8 random base-36 digits, as wandb makes its own."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def read_run_id(run_dir: Path, wait: float = 0.0) -> str | None:
    """The id in `<run_dir>/run_id`, None when there is no such file; ConfigError (one line) when it holds no id.
    `wait`: seconds to wait for a file still being written (no newline yet) by another launcher."""
    path = run_dir / RUN_ID
    deadline = time.monotonic() + wait
    while True:
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError(f"{path} is unreadable ({e.strerror}); make it readable, or delete it") from e
        if text.endswith(b"\n") or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    value = text.decode("utf-8", "replace").strip()
    if not RUN_ID_PATTERN.fullmatch(value):
        raise ConfigError(
            f"{path} holds {value[:80]!r}, not a run id (1-64 letters, digits, _ or -): delete it to start a new "
            "logger run for this run directory, or write into it the id of the run to continue"
        )
    return value


def make_run_id(run_dir: Path) -> str:
    """The run directory's id: the one in its file, else a new one written there (the first writer wins)."""
    path = run_dir / RUN_ID
    candidate = new_id()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        found = read_run_id(run_dir, wait=WRITE_WAIT)  # another node's launcher won
        if found is None:
            raise ConfigError(f"{path} appeared and vanished while this launch read it; launch again") from None
        return found
    try:
        os.write(fd, f"{candidate}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return candidate


def derived_run_id(job: str, config_hash: str, checkpoints: str | None) -> str:
    """The run id of a job whose nodes share no run directory (`launcher.clusters.Job.shared_run_dir`: a Kubernetes
    pod's is its own, and new whenever the pod is): derived alike on every node, and on every new pod, from what
    they share: the rendezvous id, the run's identity and its checkpoint folder (where it resumes from; a job of
    the same name that saves elsewhere is another run)."""
    return hashlib.sha256(f"launch-run-id:{job}:{config_hash}:{checkpoints}".encode()).hexdigest()[:8]


def manifest_run_id(checkpoint: Location) -> str | None:
    """The run id a checkpoint's manifest records (None: a checkpoint saved before manifests recorded it)."""
    from launcher.checkpoint.format import read_manifest
    from launcher.checkpoint.untrusted import UntrustedDataError

    try:
        return read_manifest(checkpoint).get("run_id")
    except UntrustedDataError as e:
        raise ConfigError(f"{e}; resume from another one") from e


def claim_run(frozen: Any, run_dir: Path, found: Location | None, job: str | None) -> Ownership:
    """Claim the run directory (`launcher.parent.rundir.claim`) and record in `frozen.job` the checkpoint a `resume=`
    names (`resume_from`), the directory's run id (`run_id`) and the other run that checkpoint belongs to (`continues`,
    else None). The id file is checked before the claim and written after it: refused input writes nothing."""
    from launcher.parent.rundir import claim

    if job is not None and not OmegaConf.select(frozen, "derived.shared_run_dir", default=True):
        known = derived_run_id(job, frozen.job.config_hash, frozen.trainer.get("checkpoint_dir"))
    else:
        known = read_run_id(run_dir)
    previous = manifest_run_id(found) if found is not None else None
    ownership = claim(run_dir, frozen.job.config_hash, job)
    try:
        run_id = known or make_run_id(run_dir)
    except BaseException:
        ownership.release()
        raise
    frozen.job.resume_from = str(found) if found else None
    frozen.job.run_id = run_id
    frozen.job.continues = previous if previous != run_id else None
    return ownership
