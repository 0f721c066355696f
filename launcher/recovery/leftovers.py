"""The memory tier's folders in shared memory that outlived their launcher (SIGKILLed, or the out-of-memory killer's):
each holds its node's share of a job's state until reboot. A launcher that starts on a host removes those of launchers
of this host that no longer run, and says so in one line.

Each folder holds its launcher's identity (`OWNER`, written by `claim`): host, pid, the kernel's start time of that
process, the boot and the pid namespace. A folder is another launcher's while that process runs: the same pid with
another start time is a new process that reused the pid (the folder's launcher is gone); a pid of another namespace
or another boot cannot be judged and is left alone, as is a folder another user owns. A folder without the record
(written by an older launcher, or one caught between making the folder and writing it) is judged by its name's pid
alone: removed only where no process has that pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from launcher.recovery.shm import PREFIX, SHM

OWNER = "owner.json"
"""The launcher that made a node's folder: {"host", "pid", "start", "boot", "pidns"}."""


def identity(pid: int | None = None) -> dict[str, Any] | None:
    """Process `pid`'s identity on this host (this process by default); None where it does not run."""
    pid = os.getpid() if pid is None else pid
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])  # field 22: start time
    except (OSError, IndexError, ValueError):
        return None
    return {"host": socket.gethostname(), "pid": pid, "start": start, "boot": _boot(), "pidns": _pidns()}


def claim(folder: Path) -> None:
    """`folder` made, owned by this launcher: its identity written into it (atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{OWNER}.partial"
    partial.write_text(json.dumps(identity()))
    os.replace(partial, folder / OWNER)


def remove_left_over(shm: Path = SHM) -> str | None:
    """The tier folders in `shm` of this user's launchers on this host that no longer run, removed; what was removed,
    in one line (None where nothing was)."""
    if not shm.is_dir():
        return None
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    removed: list[tuple[str, int]] = []
    for folder in sorted(shm.glob(f"{PREFIX}*")):
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.geteuid():
                continue  # another user's: never ours to judge
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        except OSError:  # removed meanwhile (its own launcher, ending)
            continue
        if _gone(folder, host):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append((folder.name, size))
    if not removed:
        return None
    names = ", ".join(name for name, _ in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
    total = sum(size for _, size in removed)
    return (
        f"launch: removed {len(removed)} memory-tier folder(s) in {shm} whose launcher no longer runs on this host "
        f"({names}): {total / 1e6:.1f} MB freed"
    )


def _gone(folder: Path, host: str) -> bool:
    """Whether `folder`'s launcher, of this host, no longer runs."""
    try:
        owner = json.loads((folder / OWNER).read_text())
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError):
        return False  # unreadable: not judged
    if owner is None:  # an older launcher's, or one not yet claimed: the name's pid alone, where no process has it
        name = folder.name
        pid = name.rpartition("-")[2]
        return name.endswith(f"-{host}-{pid}") and pid.isdigit() and identity(int(pid)) is None
    if not isinstance(owner, dict):
        return False
    pid, here = owner.get("pid"), identity()
    if not isinstance(pid, int) or here is None or owner.get("host") != here["host"]:
        return False  # another host's (a shared /dev/shm): its launcher cannot be seen from here
    if owner.get("boot") != here["boot"] or owner.get("pidns") != here["pidns"]:
        return False  # its pids are not this kernel's or this namespace's
    now = identity(pid)
    return now is None or now["start"] != owner.get("start")  # gone, or its pid reused by another process


def _boot() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
