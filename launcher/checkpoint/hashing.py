"""DCP's writer that hashes what it writes: each file's xxh3-128 checksum recorded as its bytes go by (no second
read), into a local folder (DCP's file-system writer, which fsyncs every file) or at a URL (its fsspec writer)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launcher.base.hashing import checksum
from launcher.base.storage import Location, is_remote, location


class _Hashing:
    """A file being written, hashed as its bytes go through `write`: no second read. A stream that moves (`seek`)
    is hashed from the file once closed."""

    def __init__(self, raw: Any) -> None:
        import xxhash

        self.raw, self.digest, self.moved = raw, xxhash.xxh3_128(), False

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        self.digest.update(memoryview(data).cast("B")[:written] if written is not None else data)
        return written

    def seek(self, *args: Any) -> int:
        self.moved = True
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


def hashing_writer(path: Location, sums: dict[str, str]) -> Any:
    """DCP's writer into `path` that records each file's xxh3-128 checksum in `sums` as it writes it: in the thread
    that writes, the background one under `dcp.async_save`. A local folder: its file-system writer, which fsyncs
    every file; a URL: its fsspec writer (an object is durable once its upload returns)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not exported by the package

    writer = FsspecWriter(str(path), sync_files=False) if is_remote(path) else dcp.FileSystemWriter(str(path))
    lock = threading.Lock()

    class HashingFileSystem(type(writer.fs)):  # type: ignore[misc]
        @contextmanager
        def create_stream(self, file: str | os.PathLike, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(file, mode) as stream:
                    yield stream
                return
            with super().create_stream(file, mode) as stream:
                hashing = _Hashing(stream)
                yield hashing
            name = Path(file).name
            digest = checksum(location(str(file))) if hashing.moved else hashing.digest.hexdigest()
            with lock:
                sums[name] = digest

        def rename(self, file: str | os.PathLike, new: str | os.PathLike) -> None:
            super().rename(file, new)
            with lock:  # DCP writes `.metadata.tmp`, then renames it
                if Path(file).name in sums:
                    sums[Path(new).name] = sums.pop(Path(file).name)

    hashing = HashingFileSystem()
    hashing.__dict__.update(writer.fs.__dict__)  # the fsspec writer's filesystem, where it has one
    writer.fs = hashing
    return writer
