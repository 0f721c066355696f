"""data=text: your text files and your tokenizer, tokenized once, in the launcher, into a cache the workers map
(the defaults of `Text` and `prepare` are the schema's, launcher/config/data_schema.py: `TextDataConfig`).

`prepare` (called by the launcher before any worker starts, `launcher.data.checks`) reads the files with
Hugging Face `datasets` (jsonl/json, parquet, txt, arrow, or a folder saved with `save_to_disk`), tokenizes every
document with `datasets.map` in `data.tokenize_workers` processes, appends the EOS token to each, chooses the
validation documents (a seeded fraction of whole documents, or `data.val_files`), and writes each split's token ids
(uint16, or uint32 for a vocabulary over 65,536 ids) and its documents' spans into a folder of the cache named by
the key of what went in: the files' paths, sizes and modification times, the tokenizer's bytes and the settings.
The folder is built under a temporary name and renamed once complete, its manifest written last: an interrupted
build leaves nothing that looks complete. `Text` (every worker) only finds that folder and memory-maps it; the
samples are those of the built-in data (`TokenWindows` packed, `DocumentChunks` padded), drawn by `GlobalBatches`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from launcher.base.durable import fsync_dir, write_durably
from launcher.base.errors import ConfigError
from launcher.base.settings import Settings
from launcher.base.storage import is_url
from launcher.data.builtin import DocumentChunks, TokenWindows, _memmap, cache_dir, largest_id
from launcher.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash

FORMAT = 1
"""The cache's layout; a new one builds new folders."""
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it (json and txt may also end in .gz, .bz2, .xz or .zst)."""
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
SAVED = ("state.json", "dataset_dict.json")
"""A folder holding one of these was written by `save_to_disk`: read with `datasets.load_from_disk`."""


def Text(split: str, **keys: Any) -> Dataset:
    """The `split` of the tokenized corpus, memory-mapped from the cache `prepare` built; never tokenizes. `keys`:
    data=text's (`TextDataConfig`).

    packing=True: documents end to end (an EOS after each), cut into windows of seq_len + 1 tokens. packing=False:
    one sample per chunk of a document, its last chunk padded (targets -100), as `data=pysource data.packing=false`.
    """
    data = Settings(**keys)
    corpus = Corpus.of(data)
    key = corpus.key()
    folder = corpus.folder(data.cache_dir, key)
    manifest = complete(folder, key)
    if manifest is None:
        raise RuntimeError(
            f"no complete token cache for data.files={data.files} at {folder}: the launcher builds it before the "
            "workers start; a file or the tokenizer changed since, launch again"
        )
    dtype = np.dtype(manifest["dtype"])
    tokens, source = _memmap(folder / f"{split}.bin", dtype), folder / f"{split}.bin"
    if data.packing:
        return TokenWindows(tokens, data.seq_len, data.format, source=source)
    spans = np.load(folder / f"{split}.spans.npy")
    return DocumentChunks(tokens, spans, data.seq_len, data.format, source=source)


def prepare(**keys: Any) -> Path:
    """In the launcher, before any worker starts: the cache folder of this corpus, found or built (one line says
    which). ConfigError (one line) for files that match nothing or lack the text field, a tokenizer that does not
    load or has no EOS token, and a data.vocab_size below the tokenizer's. `keys`: data=text's (`TextDataConfig`)."""
    data = Settings(**keys)
    corpus = Corpus.of(data)
    key = corpus.key()
    folder = corpus.folder(data.cache_dir, key)
    manifest = complete(folder, key)
    if manifest is not None:
        _check_vocab_size(data.vocab_size, manifest["vocab_size"], data.tokenizer)
        print(f"launch: data: found the tokens of {_summary(manifest)} in the cache {folder}", flush=True)
        return folder
    from launcher.data.text_build import build, check_field

    for path in (*corpus.train, *corpus.val):
        check_field(path, reader(path), data.text_field)
    tok = load_tokenizer(data.tokenizer)
    _check_vocab_size(data.vocab_size, len(tok), data.tokenizer)

    eos, partial = eos_id(tok, data.tokenizer, data.eos_token), partial_folder(folder)
    try:
        manifest = build(corpus, partial, tok, eos, data.tokenize_workers)
        publish(partial, folder, manifest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(
        f"launch: data: tokenized {_summary(manifest)} at {manifest['tokens_per_second']:,.0f} tokens/s "
        f"({data.tokenize_workers} worker process(es)) into the cache {folder}",
        flush=True,
    )
    return folder


Text.prepare = prepare  # type: ignore[attr-defined]  # what the launcher runs once before the workers start


def _check_vocab_size(vocab_size: int | None, ids: int, tokenizer: str) -> None:
    if vocab_size is not None and vocab_size < ids:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is smaller than the {ids} ids of data.tokenizer={tokenizer}; leave "
            f"data.vocab_size unset (the tokenizer's) or raise it to at least {ids}"
        )


def _summary(manifest: dict[str, Any]) -> str:
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    return (
        f"{train['documents']:,} train and {val['documents']:,} validation documents ({train['tokens']:,} and "
        f"{val['tokens']:,} tokens, {manifest['dtype']}"
        + (f"; {manifest['skipped_documents']:,} without text left out)" if manifest["skipped_documents"] else ")")
    )


@dataclass(frozen=True)
class Corpus:
    """What the tokens are made of: the files of each split, the tokenizer and the settings that change the ids."""

    train: tuple[Path, ...]
    val: tuple[Path, ...]
    """Empty: `val_fraction` of the train files' documents, chosen by `split_seed`."""
    tokenizer: Path
    settings: dict[str, Any]

    @classmethod
    def of(cls, data: Any) -> Corpus:
        """The corpus data=text's settings name (`data.files`, `data.tokenizer`...: a config node or `Settings`)."""
        path = Path(os.path.expanduser(str(data.tokenizer)))
        if not path.exists():
            raise ConfigError(
                f"data.tokenizer={data.tokenizer} does not exist; point it at a local tokenizer folder (what "
                "AutoTokenizer.from_pretrained loads, e.g. a model's folder copied from the Hub) or a tokenizer.json"
            )
        if data.txt_sample_by not in ("document", "paragraph", "line"):
            raise ConfigError(f"data.txt_sample_by={data.txt_sample_by} is not one of document, paragraph, line")
        val = expand(data.val_files, "data.val_files") if data.val_files else ()
        settings = {"text_field": data.text_field, "eos_token": data.eos_token, "txt_sample_by": data.txt_sample_by}
        if not val:
            settings |= {"val_fraction": data.val_fraction, "split_seed": data.split_seed}
        return cls(expand(data.files, "data.files"), val, path.resolve(), settings)

    def key(self) -> dict[str, Any]:
        """Everything the token ids depend on; the cache folder is named by its hash."""
        return {
            "format": FORMAT,
            "train": [_stat(p) for p in self.train],
            "val": [_stat(p) for p in self.val],
            "tokenizer": tokenizer_hash(self.tokenizer),
            **self.settings,
        }

    @staticmethod
    def reader(path: Path) -> str:
        return reader(path) or ""

    @staticmethod
    def folder(root: str | None, key: dict[str, Any]) -> Path:
        """The cache folder of `key` (`Corpus.key`) under `root` (unset: ~/.cache/launch/text)."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return (Path(os.path.expanduser(root)) if root else cache_dir() / "text") / digest


def expand(patterns: Any, key: str) -> tuple[Path, ...]:
    """Paths or globs, in the order given, each glob's matches sorted; a folder stands for the readable files under
    it (sorted), unless `save_to_disk` wrote it. ConfigError for a pattern that matches nothing or a file of a kind
    no reader takes."""
    given = [patterns] if isinstance(patterns, str) else list(patterns) if isinstance(patterns, Sequence) else []
    if not given or not all(isinstance(p, str) for p in given):
        raise ConfigError(f"{key}={patterns} is not a path, a glob or a list of them; e.g. {key}='corpus/*.jsonl'")
    found: list[Any] = []
    for pattern in given:
        if is_url(pattern):  # files in object storage (launch prepare reads them where they are)
            found += _remote(pattern, key)
            continue
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise ConfigError(f"{key}: {pattern} matches no file; check the path (relative to {Path.cwd()})")
        for match in map(Path, matches):
            if match.is_dir() and not is_saved(match):
                inside = _inside(match)
                if not inside:
                    raise ConfigError(f"{key}: the folder {match} holds no {', '.join(READERS)} file")
                found += inside
            elif reader(match) is None:
                raise ConfigError(
                    f"{key}: {match} is not a file datasets reads here; give {', '.join(READERS)} files "
                    "(json and txt may be compressed) or a folder written by save_to_disk"
                )
            else:
                found.append(match.resolve())
    return tuple(dict.fromkeys(p.resolve() for p in found))  # a file named twice is read once


def _inside(folder: Path) -> list[Path]:
    """The readable files and save_to_disk folders under `folder`, depth first, by name; hidden ones left out."""
    found: list[Path] = []
    for path in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        if path.is_dir():
            found += [path] if is_saved(path) else _inside(path)
        elif reader(path) is not None:
            found.append(path)
    return found


def _remote(pattern: str, key: str) -> list[Any]:
    """The readable files a URL names: a file, a glob (`s3://bucket/corpus/*.jsonl`) or a prefix (every file under
    it), sorted; ConfigError (one line, no credential shown) for a URL that cannot be read or names none."""
    from launcher.base.storage import Remote, check_url, masked

    scheme = pattern.partition("://")[0]
    base = re.split(r"[*?\[]", pattern, maxsplit=1)[0].rstrip("/")
    problem = check_url(base)
    if problem:
        raise ConfigError(f"{key}: {masked(pattern)}: {problem}")
    where = Remote(pattern)
    fs = where._fresh()
    if base != pattern.rstrip("/"):
        paths = fs.glob(where.path)
    else:
        paths = fs.find(where.path) if fs.isdir(where.path) else [where.path] if fs.exists(where.path) else []
    files = [Remote(f"{scheme}://{p}") for p in sorted(paths)]
    files = [f for f in files if not f.name.startswith(".") and reader(f) is not None]
    if not files:
        raise ConfigError(f"{key}: {masked(pattern)} names no {', '.join(READERS)} file")
    return files


def is_saved(path: Any) -> bool:
    return isinstance(path, Path) and path.is_dir() and any((path / name).is_file() for name in SAVED)


def reader(path: Any) -> str | None:
    """The `datasets` builder for a file ("saved" for a save_to_disk folder), or None."""
    if is_saved(path):
        return "saved"
    name = PurePosixPath(path.name)
    suffixes = name.suffixes[-2:] if name.suffix in COMPRESSED else name.suffixes[-1:]
    kind = READERS.get(suffixes[0]) if suffixes else None
    return None if name.suffix in COMPRESSED and kind not in ("json", "text") else kind


def _stat(path: Any) -> list[Any]:
    """A file's path, size and modification time (in object storage: its ETag or time); for a saved folder, those of
    every file in it."""
    if not isinstance(path, Path):
        info = path._fresh().info(path.path)
        return [str(path), int(info["size"]), str(info.get("ETag") or info.get("LastModified") or info.get("mtime"))]
    if path.is_dir():
        return [str(path), [_stat(p) for p in sorted(path.rglob("*")) if p.is_file()]]
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def complete(folder: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of a complete cache folder for `key` (its files of the sizes it records), else None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("key") != json.loads(json.dumps(key)):
            return None
        item = np.dtype(manifest["dtype"]).itemsize
        for split, counts in manifest["splits"].items():
            if (folder / f"{split}.bin").stat().st_size != counts["tokens"] * item:
                return None
            if not (folder / f"{split}.spans.npy").is_file():
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def publish(partial: Path, folder: Path, manifest: dict[str, Any]) -> None:
    """Make a built folder the cache's: every file fsynced, then the manifest (last), then the rename. A folder that
    another launch published meanwhile is kept, ours removed; one found damaged (a file of another size than its
    manifest says) is replaced."""
    for split in manifest["splits"]:
        largest_id(partial / f"{split}.bin", np.dtype(manifest["dtype"]))  # cached beside it: workers never scan
    for file in partial.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    write_durably(partial / "manifest.json", json.dumps(manifest, indent=1))
    if folder.exists() and complete(folder, manifest["key"]) is None:
        print(
            f"launch: data: the cache {folder} was damaged (its files are not the sizes it records): replaced",
            flush=True,
        )
        shutil.rmtree(folder)
    try:
        os.rename(partial, folder)
    except OSError:
        if complete(folder, manifest["key"]) is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
    fsync_dir(folder.parent)


def partial_folder(folder: Path) -> Path:
    """Where a build writes: beside its folder, named by this host and process. Those of processes of this host that
    are gone (a killed launch) are removed first."""
    host = socket.gethostname()
    folder.parent.mkdir(parents=True, exist_ok=True)
    for old in folder.parent.glob(f".*.partial-{host}-*"):
        try:
            os.kill(int(old.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
    partial = folder.parent / f".{folder.name}.partial-{host}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    return partial
