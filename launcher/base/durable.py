"""Writes that survive a crash: a reader sees the old file or the new one, never a torn or empty one."""

from __future__ import annotations

import os
from pathlib import Path


def write_durably(path: Path, text: str) -> None:
    """Write `text` to `path`: a temporary file, fsync, rename over `path`, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable: fsync the folder itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk(path: Path) -> str:
    """The file system `path` is on, in words: its device (or kind) and mount point, and its free space."""
    import shutil

    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = "the disk"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1] == str(mount):
                device = fields[0]  # the last mount there is the one in use
    except OSError:
        pass
    free = shutil.disk_usage(path).free
    return f"{device} at {mount} ({free / 1e6:,.1f} MB free)"


def disk_error(error: OSError, where: Path) -> str:
    """One line for a write under `where` that failed: a full disk is named with its free space."""
    import errno

    path = error.filename or where
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on {disk(where)} while writing {path}; free space there or choose another hydra.run.dir"
    return f"cannot write {path} ({error.strerror or type(error).__name__}); choose another hydra.run.dir"
