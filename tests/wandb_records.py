"""Read back the records of a wandb (0.31) offline run file, ``run-<id>.wandb``.

Format: a 7-byte header (``:W&B``, uint16 LE magic 0xBEE1, version byte), then
leveldb-log framing: 32 KiB blocks (offsets counted from the start of the file,
header included); each chunk is ``crc32 u32 LE | length u16 LE | type u8`` + data,
type FULL=1, FIRST=2, MIDDLE=3, LAST=4; a block tail shorter than 7 bytes, or a
zero type, is padding. The checksum is zlib's CRC-32 (IEEE, not crc32c) of the
type byte followed by the data; it is verified. Each reassembled payload is a
serialized ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto.wandb_internal_pb2 import Record

_IDENT, _MAGIC, _BLOCK, _HDR = b":W&B", 0xBEE1, 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes, path: Path) -> Iterator[bytes]:
    """Yield reassembled leveldb-log payloads from the whole file contents."""
    if len(data) < _HDR or data[:4] != _IDENT:
        raise ValueError(f"{path}: not a wandb run file (header {data[:4]!r}, want {_IDENT!r})")
    magic = struct.unpack_from("<H", data, 4)[0]
    if magic != _MAGIC:
        raise ValueError(f"{path}: bad magic 0x{magic:04X}, want 0x{_MAGIC:04X}")
    pos, parts = _HDR, None  # parts: chunks of a record being reassembled
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HDR:  # block trailer padding
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk = data[pos + _HDR : pos + _HDR + length]
        if len(chunk) != length or _HDR + length > left:
            raise ValueError(f"{path}: truncated or overlong record at offset {pos}")
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: CRC mismatch at offset {pos}")
        pos += _HDR + length
        if kind == _FULL and parts is None:
            yield chunk
        elif kind == _FIRST and parts is None:
            parts = [chunk]
        elif kind in (_MIDDLE, _LAST) and parts is not None:
            parts.append(chunk)
            if kind == _LAST:
                yield b"".join(parts)
                parts = None
        else:
            raise ValueError(f"{path}: unexpected record type {kind} at offset {pos - _HDR - length}")
    if parts is not None:
        raise ValueError(f"{path}: file ends inside a fragmented record")


def read_records(path: str | Path) -> Iterator[Record]:
    """Yield every ``Record`` in the run file at ``path``, in file order.

    Raises ValueError on a bad header/magic, a CRC mismatch or a truncated file.
    """
    path = Path(path)
    for payload in _payloads(path.read_bytes(), path):
        record = Record()
        record.ParseFromString(payload)
        yield record


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """Return one dict per history record: key -> JSON-decoded value.

    Includes wandb's own keys (``_step``, ``_runtime``, ``_timestamp``) when present.
    A ``nested_key`` item is keyed by its parts joined with ``"."``.
    """
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def find_run_file(root: str | Path) -> Path:
    """Return the single ``run-*.wandb`` file under ``root`` (searched recursively).

    Raises FileNotFoundError if there is none, ValueError if there are several.
    """
    found = sorted(Path(root).rglob("run-*.wandb"))
    if not found:
        raise FileNotFoundError(f"no run-*.wandb file under {root}")
    if len(found) > 1:
        raise ValueError(f"several run-*.wandb files under {root}: {[str(f) for f in found]}")
    return found[0]
