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
