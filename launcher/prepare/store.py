"""`launch prepare`: a token store (`launcher.data.store`) built from data=text's files and tokenizer, one shard per
input file, in parallel on one machine (`data.tokenize_workers` processes, a file each) and across machines (part i of
n: `data.shard_index=i data.num_shards=n` builds the files whose index is i modulo n).

Each shard is tokenized into a local scratch folder, its files written (uploaded) into `<out>/shards/`, then its
record `NNNNN.json`, last: a shard without its record is not built, whatever files it has. Every call skips the shards
whose records are there (a killed build goes on where it stopped) and, once every shard's record is there, writes the
store's manifest, last of all: a store without its manifest is not complete, and no run reads it. A shard's record
and the manifest carry the build's key (the files' paths, sizes and times, the tokenizer's bytes, the settings): a
record of another build is built again, a store of another build is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from launcher.base.errors import ConfigError
from launcher.base.storage import masked
from launcher.data.store import FORMAT, KIND, MANIFEST, SHARDS, open_location

BLOCK_BYTES = 4 << 20
"""The default block: the unit read, checked and cached (4 MiB)."""


def prepare_store(data: Any, out: str, part: tuple[int, int] | None, block_bytes: int = BLOCK_BYTES) -> str:
    """Build the shards of `part` (index, count; None: all) of data=text's corpus into the store at `out`, and its
    manifest once every shard is there. Returns the line that says what was done."""
    from launcher.data.text import Corpus
    from launcher.data.text_build import check_field
    from launcher.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash

    if data.get("val_files"):
        raise ConfigError(
            "data.val_files: launch prepare draws data.val_fraction of each file's documents as validation; unset "
            "data.val_files"
        )
    corpus = Corpus.of(data)  # data.val_files unset: a fraction of each file's documents
    where = open_location(out)
    tok = load_tokenizer(data.tokenizer)
    eos = eos_id(tok, data.tokenizer, data.eos_token)
    key = hashlib.sha256(
        json.dumps({"format": FORMAT, "corpus": corpus.key(), "block_bytes": block_bytes}, sort_keys=True).encode()
    ).hexdigest()[:32]
    existing = _manifest_key(where)
    if existing == key:
        return f"launch: prepare: the store at {masked(out)} is complete already ({len(corpus.train)} shards)"
    if existing is not None:
        raise ConfigError(
            f"out={masked(out)} holds a store of another build (other files, tokenizer or settings); choose another "
            "out=, or remove that store first"
        )
    files = corpus.train
    index, count = part or (0, 1)
    mine = [i for i in range(len(files)) if i % count == index]
    for i in mine:
        check_field(files[i], corpus.reader(files[i]), data.text_field)
    todo = [i for i in mine if _record(where, i, key) is None]
    settings = {
        "dtype": "uint16" if len(tok) <= 1 << 16 else "uint32",
        "eos": eos,
        "block_bytes": block_bytes,
        "tokenizer": str(data.tokenizer),
        "val_fraction": float(data.val_fraction),
        "split_seed": int(data.split_seed),
        "key": key,
        "out": str(out),
    }
    started = time.monotonic()
    tokens = sum(_build(corpus, todo, settings, int(data.tokenize_workers)))
    seconds = time.monotonic() - started
    built = (
        f"built {len(todo)} of its {len(mine)} shard(s) ({len(mine) - len(todo)} found built) in {seconds:.1f} s, "
        f"{tokens:,} tokens at {tokens / max(seconds, 1e-9):,.0f} tokens/s with {data.tokenize_workers} worker "
        "process(es)"
    )
    what = f"part {index} of {count}: " if part else ""
    records = [_record(where, i, key) for i in range(len(files))]
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        return (
            f"launch: prepare: {what}{built}; {len(missing)} of {len(files)} shards are not built yet (e.g. shard "
            f"{missing[0]:05d}, part {missing[0] % count}): the manifest is written by the call that finds them all"
        )
    manifest = {
        "kind": KIND,
        "format": FORMAT,
        "key": key,
        "dtype": settings["dtype"],
        "vocab_size": len(tok),
        "eos_id": eos,
        "tokenizer": tokenizer_hash(corpus.tokenizer),
        "block_bytes": block_bytes,
        "settings": {k: corpus.settings[k] for k in sorted(corpus.settings)},
        "shards": records,
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    _write_text(where / MANIFEST, json.dumps(manifest))
    total = sum(r["splits"][s]["tokens"] for r in records for s in ("train", "val"))  # type: ignore[index]
    return (
        f"launch: prepare: {what}{built}; the store is complete: {len(files)} shards, {total:,} tokens, "
        f"{masked(out)}/{MANIFEST} (train on it with data=store data.url={masked(out)})"
    )


def _manifest_key(where: Any) -> str | None:
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{masked(str(where))}/{MANIFEST} is unreadable ({type(e).__name__}); remove it") from e
    return manifest.get("key") if isinstance(manifest, dict) else ""


def _record(where: Any, index: int, key: str) -> dict[str, Any] | None:
    """Shard `index`'s record, when it is there and of this build."""
    try:
        record = json.loads((where / SHARDS / f"{index:05d}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def _build(corpus: Any, todo: list[int], settings: dict[str, Any], workers: int) -> list[int]:
    """Each shard of `todo` built; its tokens. In `workers` processes (a shard each) when there are several."""
    jobs = [(corpus, i, settings) for i in todo]
    if workers <= 1 or len(jobs) <= 1:
        return [build_shard(*job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(build_shard, *zip(*jobs)))


def build_shard(corpus: Any, index: int, settings: dict[str, Any]) -> int:
    """Tokenize input file `index` into shard `index`: its files, then its record; the shard's tokens."""
    from launcher.base.hashing import xxh3
    from launcher.data.text_build import Encode, choose_val, document_lengths, tokenized, write
    from launcher.data.tokenizer import load_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per shard: no thread pool under it
    started, name = time.monotonic(), f"{index:05d}"
    where, dtype, block = open_location(settings["out"]), np.dtype(settings["dtype"]), settings["block_bytes"]
    file = corpus.train[index]
    scratch = Path(tempfile.mkdtemp(prefix=f"launch-shard-{name}-{socket.gethostname()}-"))
    try:
        import datasets

        datasets.disable_progress_bars()
        ids = tokenized(
            (file,), corpus, scratch, Encode(load_tokenizer(settings["tokenizer"]), settings["eos"]), 0, name
        )
        lengths = document_lengths(ids)
        in_val = choose_val(lengths > 0, settings["val_fraction"], [settings["split_seed"], index])
        splits: dict[str, Any] = {}
        for split, keep in (("train", (lengths > 0) & ~in_val), ("val", in_val)):
            counts = write(scratch, split, ids, keep, dtype)
            tokens_file, docs_file = scratch / f"{split}.bin", scratch / f"{split}.docs"
            docs = np.load(scratch / f"{split}.spans.npy")[:, 1].astype("<i8").tobytes()
            docs_file.write_bytes(docs)
            sums, largest = [], 0
            with open(tokens_file, "rb") as f:
                while chunk := f.read(block):
                    sums.append(xxh3(chunk))
                    largest = max(largest, int(np.frombuffer(chunk, dtype=dtype).max(initial=0)))
            _put(tokens_file, where / SHARDS / f"{name}.{split}.tokens")
            _put(docs_file, where / SHARDS / f"{name}.{split}.docs")
            splits[split] = {**counts, "max_id": largest, "blocks": sums, "docs_xxh3": xxh3(docs)}
        del ids
        record = {
            "name": name,
            "key": settings["key"],
            "source": str(file),
            "splits": splits,
            "skipped_documents": int((lengths == 0).sum()),
        }
        _write_text(where / SHARDS / f"{name}.json", json.dumps(record))  # last: the shard is built
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokens = sum(s["tokens"] for s in splits.values())
    print(
        f"launch: prepare: shard {name} ({file.name}): {tokens:,} tokens in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    return tokens


def _put(local: Path, where: Any) -> None:
    """A shard file into the store: uploaded at a URL, moved (and fsynced) into a local folder."""
    if isinstance(where, Path):
        where.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(local), str(where))
        with open(where, "rb") as f:
            os.fsync(f.fileno())
        return
    where.fs.put_file(str(local), where.path)


def _write_text(where: Any, text: str) -> None:
    from launcher.base.storage import write_durably

    if isinstance(where, Path):
        where.parent.mkdir(parents=True, exist_ok=True)
    write_durably(where, text)
