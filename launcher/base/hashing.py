"""xxh3-128 checksums: of bytes, and of a file read in chunks (a local path or a `launcher.base.storage.Remote`)."""

from __future__ import annotations

from typing import Any

CHUNK = 8 << 20


def xxh3(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()


def checksum(path: Any) -> str:
    """The xxh3-128 checksum of a file's bytes, as `launcher.checkpoint.saving` records it while writing."""
    import xxhash

    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
