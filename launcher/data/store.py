"""data=store: a tokenized corpus in shards, in a local folder or at an fsspec URL (S3 first), built by
`launch prepare` (`launcher.prepare.store`), read by every rank through a bounded local cache.

The store (what `launch prepare` writes, the manifest last):

    <url>/manifest.json                  the store: its format, token dtype, vocabulary, EOS, tokenizer hash, the
                                         settings, the block size, and each shard's record (below)
    <url>/shards/NNNNN.json              one shard's record, written after its files: per split, its tokens,
                                         documents, largest id, the xxh3-128 checksum of every block of its tokens
                                         file and of its documents file
    <url>/shards/NNNNN.{train,val}.tokens   the split's token ids end to end (little-endian uint16 or uint32)
    <url>/shards/NNNNN.{train,val}.docs     its documents' end offsets (little-endian int64)

Samples are those of data=text, drawn within a shard: packed, windows of seq_len + 1 tokens every seq_len over the
shard's tokens (an EOS after each document); padded, one sample per chunk of a document, its last chunk padded
(targets -100). A sample reads only the blocks (`block_bytes`, 4 MiB by default) its tokens are in; every block is
checked against its checksum before use, once fetched (a flipped byte, a truncated object: refused, naming the shard
and the block). Remote blocks go through the cache (`data.cache_dir`, `data.cache_limit`): written whole under a lock
that evicts the least recently used first, so the folder never holds more than the limit, and read from there by
any rank or loader process of the node.

The order is the batch contract's (`launcher.data.builtin.GlobalBatches`): a permutation per epoch of the seed alone,
made here to read few blocks at a time (`epoch_order`): the blocks' sample groups are permuted, and the samples of each
run of `data.shuffle_blocks` consecutive groups are permuted among themselves. It depends on the seed and the store,
never on the world size, so every guarantee of a map-style dataset holds (G ranks x K micro-steps equals one process
with G*K; a resume at another world size, an elastic resize, go on with the same samples).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.base.errors import ConfigError
from launcher.base.settings import Settings
from launcher.base.storage import masked
from launcher.data.builtin import FORMATS, cache_dir

FORMAT = 1
KIND = "launch-token-store"
MANIFEST = "manifest.json"
SHARDS = "shards"
DTYPES = ("uint16", "uint32")


class StoreError(ValueError):
    """A store, shard or block the run cannot use: one line naming it and the fix."""


def open_location(url: str) -> Any:
    """The store's location (a local folder or a `Remote`), checked: ConfigError (one line, the URL's credentials never
    shown) for a URL that carries credentials, a protocol that is not installed, a bucket that is not there or
    cannot be read."""
    from launcher.base.storage import check_url, is_url, location

    if is_url(str(url)):
        problem = check_url(str(url))
        if problem:
            raise ConfigError(f"data.url={masked(url)}: {problem}")
    return location(str(url))


@cache
def read_manifest(url: str) -> dict[str, Any]:
    """The store's manifest, read once per process and checked as untrusted data: ConfigError (one line) where there is
    none or it is not a store's."""
    where = open_location(url) / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError as e:
        raise ConfigError(
            f"data.url={masked(url)} holds no {MANIFEST}: not a token store, or one whose build has not finished "
            "(launch prepare writes it last, once every shard is built: run it again to finish)"
        ) from e
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"data.url={masked(url)}: {MANIFEST} is unreadable ({type(e).__name__}: {e})") from e
    problem = _manifest_problem(manifest)
    if problem:
        raise ConfigError(f"data.url={masked(url)}: {MANIFEST} {problem}; build the store again with launch prepare")
    return manifest


def _manifest_problem(m: Any) -> str | None:
    """Why a manifest is not one `launch prepare` wrote, or None."""
    if not isinstance(m, dict) or m.get("kind") != KIND:
        return "is not a token store's"
    if not isinstance(m.get("key"), str) or not re.fullmatch(r"[0-9a-f]{24,64}", m["key"]):
        return "has no key"
    if m.get("format") != FORMAT:
        return f"has format {m.get('format')!r}, this launch reads {FORMAT}"
    if m.get("dtype") not in DTYPES or not all(_count(m.get(k)) for k in ("vocab_size", "block_bytes")):
        return "has a bad dtype, vocab_size or block_bytes"
    if not isinstance(m.get("shards"), list) or not m["shards"]:
        return "lists no shard"
    for shard in m["shards"]:
        if not isinstance(shard, dict) or not re.fullmatch(r"\d{5}", str(shard.get("name"))):
            return f"has a bad shard entry {str(shard)[:80]!r}"
        for split in ("train", "val"):
            part = shard.get("splits", {}).get(split)
            if not isinstance(part, dict) or not all(_count(part.get(k), 0) for k in ("tokens", "documents")):
                return f"has a bad {split} entry for shard {shard['name']}"
            blocks = part.get("blocks")
            expected = -(-part["tokens"] * np.dtype(m["dtype"]).itemsize // m["block_bytes"])
            if not isinstance(blocks, list) or len(blocks) != expected or not all(isinstance(b, str) for b in blocks):
                listed = len(blocks) if isinstance(blocks, list) else "no"
                return f"lists {listed} block checksums for shard {shard['name']}'s {split} tokens, not {expected}"
            if not isinstance(part.get("docs_xxh3"), str):
                return f"records no checksum of shard {shard['name']}'s {split} documents"
    return None


def _count(value: Any, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def store_vocab(url: str) -> int:
    """The resolver `${launch_store_vocab:URL}`: the ids the store's tokenizer gives (data.vocab_size unless set)."""
    return int(read_manifest(str(url))["vocab_size"])


def parse_bytes(value: Any, key: str) -> int:
    """A size given as bytes or as text with a unit (500MB, 2GB, 1.5GiB)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", str(value), re.IGNORECASE)
    if match:
        unit = (match[2] or "B").upper()
        scale = {
            "B": 1,
            "KB": 1e3,
            "MB": 1e6,
            "GB": 1e9,
            "TB": 1e12,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        size = int(float(match[1]) * scale)
        if size > 0:
            return size
    raise ConfigError(f"{key}={value} is not a size; give bytes or a number with a unit, e.g. {key}=20GB")


class BlockCache:
    """Verified blocks of a store's files on the local disk, at most `limit` bytes: fetched whole, checked against
    their checksums, then admitted under a lock that first evicts the least recently used (a block's last read sets
    its time). Shared by every process of a node that reads the store (ranks, loader processes)."""

    def __init__(self, root: Path, limit: int, location: Any) -> None:
        self.root, self.limit, self.location = root, limit, location
        root.mkdir(parents=True, exist_ok=True)

    def read(
        self,
        file: str,
        block: int,
        start: int,
        offset: int,
        count: int,
        dtype: np.dtype,
        size: int,
        digest: str,
        what: str,
    ) -> np.ndarray:
        """`count` items of `dtype` at `offset` (bytes) within block `block` of `file`, which starts at byte `start`
        of it and is `size` bytes long."""
        path = self.root / f"{file}.{block:06d}"
        try:
            with open(path, "rb") as f:
                os.utime(f.fileno())  # read now: the last to be evicted
                f.seek(offset)
                return np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype)
        except FileNotFoundError:
            pass
        data = fetched(self.location / SHARDS / file, start, size, digest, what)
        self._admit(path, data)
        return np.frombuffer(data[offset : offset + count * dtype.itemsize], dtype=dtype)

    def _admit(self, path: Path, data: bytes) -> None:
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = sorted(
                (entry.stat().st_mtime_ns, entry.stat().st_size, entry)
                for entry in self.root.iterdir()
                if not entry.name.startswith(".")
            )
            total = sum(size for _, size, _ in held)
            for _, size, entry in held:
                if total + len(data) <= self.limit:
                    break
                entry.unlink(missing_ok=True)
                total -= size
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)


def fetched(where: Any, start: int, size: int, digest: str, what: str) -> bytes:
    """`size` bytes of the file at `where` from `start` (a block, or a whole documents file), read and checked against
    their xxh3-128 checksum; StoreError naming them otherwise."""
    from launcher.base.hashing import xxh3

    try:
        if isinstance(where, Path):
            with open(where, "rb") as f:
                f.seek(start)
                data = f.read(size)
        else:
            data = bytes(where.fs.cat_file(where.path, start=start, end=start + size))
    except FileNotFoundError as e:
        raise StoreError(f"{what} is missing from the store ({masked(str(where))}); build that shard again") from e
    if len(data) != size:
        raise StoreError(
            f"{what} is truncated: {size:,} bytes recorded, {len(data):,} read ({masked(str(where))}); build that "
            "shard again (launch prepare) or restore the object"
        )
    if xxh3(data) != digest:
        raise StoreError(
            f"{what} fails its checksum (xxh3-128): its bytes changed after the store was built ({masked(str(where))});"
            " build that shard again (launch prepare) or restore the object"
        )
    return data


class Store(Dataset):
    """One split of a token store, by index: packed windows or padded document chunks, read block by block."""

    def __init__(self, split: str, **keys: Any) -> None:
        """`keys`: data=store's (launcher/config/data_schema.py: `StoreDataConfig`, their one place)."""
        data = Settings(**keys)
        if data.format not in FORMATS:
            raise ValueError(f"data.format={data.format} is not one of {', '.join(FORMATS)}")
        url = str(data.url)
        manifest = read_manifest(url)
        if data.tokenizer is not None:
            _check_tokenizer(manifest, data.tokenizer, url)
        self.url, self.split, self.seq_len, self.packing, self.format = (
            url,
            split,
            data.seq_len,
            data.packing,
            data.format,
        )
        self.shuffle_blocks = data.shuffle_blocks
        self.dtype, self.block_bytes = np.dtype(manifest["dtype"]), int(manifest["block_bytes"])
        self.shards = [s for s in manifest["shards"] if s["splits"][split]["tokens"] > 0]
        self.location = open_location(self.url)
        self.remote = not isinstance(self.location, Path)
        limit = parse_bytes(data.cache_limit, "data.cache_limit")
        if self.remote and limit < 2 * self.block_bytes:
            raise ConfigError(
                f"data.cache_limit={data.cache_limit} holds fewer than two of the store's blocks of "
                f"{self.block_bytes:,} bytes; raise it (each rank reads a few blocks at a time), e.g. data.cache_limit="
                f"{max(1, 64 * self.block_bytes // 10**6)}MB"
            )
        root = Path(os.path.expanduser(data.cache_dir)) if data.cache_dir else cache_dir_default()
        self.cache = BlockCache(root / manifest["key"][:24], limit, self.location) if self.remote else None
        self.verified: set[tuple[str, int]] = set()
        self._counts()

    # ------------------------------------------------------------------ samples

    def _counts(self) -> None:
        """Samples per shard, and where each shard's start in the global index."""
        L = self.seq_len
        if self.packing:
            per = [max(0, (s["splits"][self.split]["tokens"] - 1) // L) for s in self.shards]
            self.chunks: list[np.ndarray | None] = [None] * len(self.shards)
        else:
            self.chunks = [self._chunks(s) for s in self.shards]
            per = [len(c) for c in self.chunks]  # type: ignore[arg-type]
        self.starts = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
        if self.starts[-1] == 0:
            raise ValueError(
                f"data.url={masked(self.url)}: its {self.split} split cannot make one sample of data.seq_len={L} "
                f"({sum(s['splits'][self.split]['tokens'] for s in self.shards):,} tokens)"
            )

    def _chunks(self, shard: dict[str, Any]) -> np.ndarray:
        """A shard's padded samples: (first token, tokens) of each chunk of each document, as data=text cuts them."""
        part = shard["splits"][self.split]
        name = f"{shard['name']}.{self.split}.docs"
        data = fetched(self.location / SHARDS / name, 0, part["documents"] * 8, part["docs_xxh3"], f"shard {name}")
        ends = np.frombuffer(data, dtype="<i8")
        begins = np.concatenate([[0], ends[:-1]])
        L = self.seq_len
        per_doc = np.maximum(0, ends - begins - 1 + L - 1) // L
        doc = np.repeat(np.arange(len(ends)), per_doc)
        nth = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        first = begins[doc] + nth * L
        return np.stack([first, np.minimum(L + 1, ends[doc] - first)], axis=1)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> Any:
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        j = int(i - self.starts[s])
        L = self.seq_len
        if self.packing:
            first, n = j * L, L + 1
        else:
            first, n = (int(v) for v in self.chunks[s][j])  # type: ignore[index]
        chunk = torch.zeros(L + 1, dtype=torch.int64)
        chunk[:n] = torch.from_numpy(self._tokens(self.shards[s], first, n).astype(np.int64))
        if self.format == "hf":
            inputs = chunk[:-1]
            labels = inputs.clone()
            labels[n:] = -100
            return {"input_ids": inputs, "labels": labels}
        targets = chunk[1:].clone()
        targets[n - 1 :] = -100
        return chunk[:-1], targets

    def _tokens(self, shard: dict[str, Any], first: int, count: int) -> np.ndarray:
        """`count` tokens of a shard's split from token `first`: the blocks they are in, each verified."""
        part, item = shard["splits"][self.split], self.dtype.itemsize
        file, total = f"{shard['name']}.{self.split}.tokens", part["tokens"] * item
        begin, end = first * item, (first + count) * item
        pieces = []
        for block in range(begin // self.block_bytes, (end - 1) // self.block_bytes + 1):
            lo = block * self.block_bytes
            size = min(self.block_bytes, total - lo)
            a, b = max(begin, lo) - lo, min(end, lo + size) - lo
            what = f"shard {shard['name']}'s {self.split} tokens ({file}), block {block}"
            if self.cache is not None:
                pieces.append(
                    self.cache.read(file, block, lo, a, (b - a) // item, self.dtype, size, part["blocks"][block], what)
                )
            else:
                pieces.append(self._local(file, block, a, b, size, part["blocks"][block], what))
        return np.concatenate(pieces)

    def _local(self, file: str, block: int, a: int, b: int, size: int, digest: str, what: str) -> np.ndarray:
        """A local store's bytes [a, b) of a block: the block checked once per process, then read in place."""
        if (file, block) not in self.verified:
            fetched(self.location / SHARDS / file, block * self.block_bytes, size, digest, what)
            self.verified.add((file, block))
        with open(self.location / SHARDS / file, "rb") as f:
            f.seek(block * self.block_bytes + a)
            return np.frombuffer(f.read(b - a), dtype=self.dtype)

    # ------------------------------------------------------------------ what the launcher asks of it

    def largest_id(self) -> int:
        """The largest token id of the split, as the build recorded it (checked before start)."""
        return max(int(s["splits"][self.split].get("max_id", 0)) for s in self.shards)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The permutation of an epoch, from the seed alone: groups of samples that share a block are permuted, then
        the samples of each run of `shuffle_blocks` consecutive groups among themselves, so that a stretch of steps
        reads few blocks."""
        per_group = max(1, self.block_bytes // (self.seq_len * self.dtype.itemsize))
        starts = np.concatenate(
            [np.arange(self.starts[s], self.starts[s + 1], per_group) for s in range(len(self.shards))]
        )
        ends = np.append(starts[1:], self.starts[-1])
        ends = np.minimum(ends, self.starts[np.searchsorted(self.starts, starts, side="right")])
        rng = np.random.default_rng([seed, epoch])
        groups = rng.permutation(len(starts))
        order = []
        for run in range(0, len(groups), self.shuffle_blocks):
            members = np.concatenate([np.arange(starts[g], ends[g]) for g in groups[run : run + self.shuffle_blocks]])
            order.append(members[rng.permutation(len(members))])
        return np.concatenate(order).astype(np.int64)


def cache_dir_default() -> Path:
    return cache_dir() / "store"


def _check_tokenizer(manifest: dict[str, Any], tokenizer: str, url: str) -> None:
    from launcher.data.tokenizer import tokenizer_hash

    path = Path(os.path.expanduser(str(tokenizer)))
    if not path.exists():
        raise ConfigError(
            f"data.tokenizer={tokenizer} does not exist; point it at the tokenizer the store was built with"
        )
    if tokenizer_hash(path.resolve()) != manifest.get("tokenizer"):
        raise ConfigError(
            f"data.url={masked(url)} was built with another tokenizer than data.tokenizer={tokenizer} (their files "
            "differ): its token ids mean other text; give the tokenizer it was built with, or build a store with this "
            "one (launch prepare)"
        )
