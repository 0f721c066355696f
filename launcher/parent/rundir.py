"""A run owns its directory: a claim taken after every check has passed, before the launcher writes anything.

`<run dir>/claim.json` records the run that owns the directory: its identity (`launcher.config.identity`), its job
(the rendezvous id that every node of a multi-node job shares), the command, host, pid and time. On one node
the owning launcher also holds an exclusive lock on `<run dir>/.lock` while it runs.

- no claim: the directory becomes this run's (unless it holds another run's checkpoints);
- a claim of another run (another identity): refused, nothing touched;
- a claim of the same run: a reused directory resumes, unless a launch of it is running right now (the lock is
  held), or, across nodes, the claim names this very job (the other nodes of one job share it).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from launcher.config import ConfigError

CLAIM = "claim.json"
LOCK = ".lock"

MADE: list[Path] = []
"""The run directory and those of its parents that did not exist before this launch, deepest first: the only
folders a refused run removes."""


class NewFolders(Callback):
    """Hydra callback: before Hydra makes the run directory, which folders of its path are new (`MADE`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.run.dir)).absolute()
        MADE[:] = [p for p in (run_dir, *run_dir.parents) if not p.exists()]


def remove_made(run_dir: Path) -> None:
    """Remove what this launch made of `run_dir` (it and everything in it, if the launch made the folder; then each
    parent the launch made, once empty), and nothing else."""
    import shutil

    made = [p for p in MADE if p == run_dir.absolute() or p in run_dir.absolute().parents]
    if not made or made[0] != run_dir.absolute():
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in made[1:]:
        try:
            folder.rmdir()
        except OSError:
            break


@dataclass
class Ownership:
    """The claim this launch holds; `release` at the end of the run (the claim file stays: the directory's record)."""

    lock: IO[str] | None

    def release(self) -> None:
        if self.lock is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
            self.lock = None


def _close_in_child(lock: IO[str]) -> None:
    """A forked worker does not hold the launcher's lock: the directory is free once the launcher is gone."""
    if not lock.closed:
        lock.close()  # this process's descriptor only (no unlock): the lock stays the launcher's while it holds it


def _read_claim(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / CLAIM
    if not path.exists():
        return None
    try:
        claim = json.loads(path.read_text())
        if isinstance(claim, dict) and isinstance(claim.get("config_hash"), str):
            return claim
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    raise ConfigError(
        f"{path} is unreadable: hydra.run.dir={run_dir} has an unknown owner; choose another hydra.run.dir"
    )


def _who(claim: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(claim.get("time", 0))))
    return f"pid {claim.get('pid')} on {claim.get('host')}, since {when}"


def _foreign_checkpoints(run_dir: Path, config_hash: str) -> str | None:
    """A checkpoint of another run in a directory nobody claimed (written before claims existed)."""
    from launcher.checkpoint.format import latest, read_manifest
    from launcher.checkpoint.untrusted import UntrustedDataError

    found = latest(run_dir / "checkpoints")
    try:
        other = found is not None and read_manifest(found)["config_hash"] != config_hash
    except UntrustedDataError:
        other = True
    return str(found) if other else None


JOB_PATIENCE = 10.0
"""Seconds a node of a multi-node job waits for the run directory's lock, which the job's other nodes hold only while
they write the claim (a launch on one node holds it for its whole run)."""


def _locked(lock: IO[str], patience: float) -> bool:
    """Take `lock` exclusively, trying for `patience` seconds; whether it was taken."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def claim(run_dir: Path, config_hash: str, job: str | None, command: list[str] | None = None) -> Ownership:
    """Claim `run_dir` for this run, or raise ConfigError (one line) without writing anything.

    `job`: the id every node of a multi-node job shares (None on one node: then a lock guards the directory).
    """
    held = _read_claim(run_dir)
    if held is not None and held["config_hash"] != config_hash:
        raise ConfigError(
            f"hydra.run.dir={run_dir} belongs to another run (config hash {held['config_hash']}, {_who(held)}); "
            f"choose another hydra.run.dir, or start from its checkpoint with resume={run_dir}"
        )
    if held is None and (other := _foreign_checkpoints(run_dir, config_hash)):
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds checkpoints of another run ({other}); "
            f"choose another hydra.run.dir, or start from them with resume={run_dir}"
        )
    lock = None
    if job is None or held is None or held.get("job") != job:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / LOCK, "a")  # held open while the run lasts
        # Across nodes another node of this job holds the lock for the moment it writes the claim: wait for that.
        if not _locked(lock, patience=0.0 if job is None else JOB_PATIENCE):
            lock.close()
            now = _read_claim(run_dir) or {}
            raise ConfigError(
                f"hydra.run.dir={run_dir} is in use by another launch ({_who(now)}); "
                "wait for it to end, or choose another hydra.run.dir"
            ) from None
        os.register_at_fork(after_in_child=functools.partial(_close_in_child, lock))  # workers forked from here
        if job is not None:  # another node of this job may have claimed it while this one waited for the lock
            held = _read_claim(run_dir)
            if held is not None and held["config_hash"] != config_hash:
                Ownership(lock).release()
                raise ConfigError(
                    f"hydra.run.dir={run_dir} belongs to another run (config hash {held['config_hash']}, "
                    f"{_who(held)}); choose another hydra.run.dir"
                )
    from launcher.base.durable import write_durably

    record = {
        "config_hash": config_hash,
        "job": job,
        "command": command if command is not None else sys.argv,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
    }
    if held is None or held.get("job") != job or job is None:
        write_durably(run_dir / CLAIM, json.dumps(record, indent=2))
    if job is not None and lock is not None:  # across nodes the lock only orders the claim's writes; the claim names
        Ownership(lock).release()  # the job, which its other nodes share
        lock = None
    return Ownership(lock)
