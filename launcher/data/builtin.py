"""Built-in data and the global-batch sampler (each data function's defaults are its schema's,
launcher/config/data_schema.py; `launcher.config.context.preset_dataset` builds one outside a run).

The data contract: a data `_target_` is called with `split="train"` or `split="val"` (plus its own config keys) and
returns a dataset: a map-style one (a length and items by index: the built-in ones, a `datasets.Dataset`) or an iterable
one (a stream); `launcher.data.sources` draws each step's samples from either, and `launcher.data.collate` makes a
rank's micro-batches of them.

Which samples an optimizer step sees depends only on the seed and the global batch size, never on the world size or
the accumulation steps: for a map-style dataset, the step that starts at global sample index p takes positions
[p, p+B) of a seeded permutation per epoch (`GlobalBatches`), and every (rank, micro-step) takes a fixed slice of
them (`rank_micro_batches`). A resumed run continues from the sample index its checkpoint recorded.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.base.settings import Settings

FORMATS = ("tuple", "hf")


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array.

    format="tuple": (inputs, next-token targets), for the built-in GPT's forward(idx, targets).
    format="hf": {"input_ids", "labels"} with labels equal to input_ids (unshifted): a Hugging Face causal LM
    shifts its labels itself, so shifting them here too would teach it the token after next.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, format: str = "tuple", source: Path | None = None) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot make one sample of data.seq_len={seq_len}")
        if format not in FORMATS:
            raise ValueError(f"data.format={format} is not one of {', '.join(FORMATS)}")
        self.tokens, self.seq_len, self.format, self.source = tokens, seq_len, format, source
        self.n = (len(tokens) - 1) // seq_len

    def largest_id(self) -> int:
        """The largest token id it can give: of its whole file when it has one (scanned once, cached), else of its
        tokens."""
        if self.source is not None:
            return largest_id(self.source, self.tokens.dtype)
        return int(self.tokens.max(initial=0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        if self.format == "hf":
            inputs = chunk[:-1]
            return {"input_ids": inputs, "labels": inputs.clone()}
        return chunk[:-1], chunk[1:]


def largest_id(path: Path, dtype: Any = None) -> int:
    """The largest id in a token file of `dtype` (uint16 unless given), scanned once and cached beside it in
    `<file>.max-id.json`, keyed by the file's size and modification time so that a changed file is scanned again.
    Where that folder is read-only it is scanned every time."""
    import json

    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(np.dtype(dtype or np.uint16))}
    cache = path.with_name(f"{path.name}.max-id.json")
    try:
        cached = json.loads(cache.read_text())
        if {k: cached.get(k) for k in key} == key:
            return int(cached["max_id"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    tokens = _memmap(path, np.dtype(key["dtype"]))
    largest = 0
    for start in range(0, len(tokens), 1 << 26):  # 64M tokens a time: bounded memory on any file size
        largest = max(largest, int(tokens[start : start + (1 << 26)].max(initial=0)))
    try:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**key, "max_id": largest}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only folder: nothing cached
    return largest


def _memmap(path: Path, dtype: Any) -> np.ndarray:
    """A token file, memory-mapped (numpy cannot map an empty file: that is no tokens)."""
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.empty(0, dtype=dtype)


def _split(tokens: np.ndarray, split: str, val_fraction: float) -> np.ndarray:
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut] if split == "train" else tokens[cut:]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "launch"


def PySource(split: str, **keys: Any) -> Dataset:
    """Byte-level tokens of the running Python's standard-library .py files.

    Files are assigned to train or validation by a hash of their relative path, so the split is
    deterministic and no file is in both. Built once into a cache file, then memory-mapped.
    packing=True: the files end to end, cut into windows of seq_len tokens (every sample full).
    packing=False: one sample per chunk of a document (a block of a file between blank lines: a function, a class),
    each document split at seq_len and its last chunk padded, so samples hold different numbers of real tokens (the
    padded targets are -100). A whole file is rarely shorter than a chunk; a block often is. `keys`: data=pysource's
    (launcher/config/data_schema.py: `PySourceDataConfig`, their one place).
    """
    data = Settings(**keys)
    root = Path(sysconfig.get_paths()["stdlib"])
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    tag = f"{version}-{zlib.crc32(str(root).encode()):08x}-{data.val_fraction:g}-v2"
    path = cache_dir() / f"pysource-{tag}-{split}.bin"
    spans = path.with_suffix(".spans.npy")
    if not (path.exists() and spans.exists()):
        _build_pysource(root, data.val_fraction, path.parent, tag)
    tokens = _memmap(path, np.uint8)
    if data.packing:
        return TokenWindows(tokens, data.seq_len, data.format, source=path)
    return DocumentChunks(tokens, np.load(spans), data.seq_len, data.format, source=path)


def _build_pysource(root: Path, val_fraction: float, out: Path, tag: str) -> None:
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        split = "val" if zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000 else "train"
        parts[split].append(file.read_bytes())
    out.mkdir(parents=True, exist_ok=True)
    for split, chunks in parts.items():
        # The files joined by a newline (what packing reads), and the spans of their documents in that: a document
        # is a block of a file between blank lines (a function, a class, a run of statements).
        spans, offset = [], 0
        for content in chunks:
            spans += [
                (offset + m.start(), offset + m.end()) for m in re.finditer(rb"(?:[^\n]|\n(?![ \t]*\n))+", content)
            ]
            offset += len(content) + 1
        for name, data in (
            (f"{split}.spans.npy", np.asarray(spans, dtype=np.int64).reshape(-1, 2)),
            (f"{split}.bin", b"\n".join(chunks)),
        ):
            tmp = out / f".pysource-{tag}-{name}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                np.save(f, data) if isinstance(data, np.ndarray) else f.write(data)
            os.replace(tmp, out / f"pysource-{tag}-{name}")  # atomic: ranks may race to build


class DocumentChunks(Dataset):
    """One sample per chunk of a document: a document of n tokens ([begin, end) in `tokens`) gives chunks of
    seq_len + 1 tokens every seq_len, the last one shorter and padded (inputs with 0, targets with -100), so its
    sample holds fewer targets. A chunk of one token has no target and is left out.

    format="tuple": (inputs, targets); format="hf": {"input_ids", "labels"} with labels unshifted (-100 where padded).
    """

    def __init__(
        self, tokens: np.ndarray, spans: np.ndarray, seq_len: int, format: str = "tuple", source: Path | None = None
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"data.format={format} is not one of {', '.join(FORMATS)}")
        begin, end = spans[:, 0], spans[:, 1]
        per_doc = np.maximum(0, end - begin - 1 + seq_len - 1) // seq_len  # chunks with at least one target
        if not per_doc.sum():
            raise ValueError(f"{len(tokens)} tokens in {len(spans)} documents cannot make one sample")
        doc = np.repeat(np.arange(len(spans)), per_doc)
        nth = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)  # chunk index in its document
        first, ends = begin[doc] + nth * seq_len, end[doc]
        self.tokens, self.seq_len, self.format = tokens, seq_len, format
        self.chunks = np.stack([first, np.minimum(seq_len + 1, ends - first)], axis=1)
        self.source = source

    def largest_id(self) -> int:
        """The largest token id it can give (padding is 0): of its file, scanned once and cached."""
        return largest_id(self.source, self.tokens.dtype) if self.source else int(self.tokens.max(initial=0))

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> Any:
        start, n = (int(v) for v in self.chunks[i])
        chunk = torch.zeros(self.seq_len + 1, dtype=torch.int64)
        chunk[:n] = torch.from_numpy(self.tokens[start : start + n].astype(np.int64))
        if self.format == "hf":
            inputs = chunk[:-1]
            labels = inputs.clone()
            labels[n:] = -100  # padding is no target (transformers shifts labels: real targets are 1..n-1)
            return {"input_ids": inputs, "labels": labels}
        targets = chunk[1:].clone()
        targets[n - 1 :] = -100
        return chunk[:-1], targets


def Synthetic(split: str, **keys: Any) -> TokenWindows:
    """Uniform random tokens from a fixed seed per split. `keys`: data=synthetic's (`SyntheticDataConfig`)."""
    data = Settings(**keys)
    n = data.num_samples if split == "train" else max(1, data.num_samples // 10)
    rng = np.random.default_rng(0 if split == "train" else 1)
    dtype = np.uint16 if data.vocab_size <= 2**16 else np.uint32
    tokens = rng.integers(0, data.vocab_size, size=n * data.seq_len + 1, dtype=dtype)
    return TokenWindows(tokens, data.seq_len, data.format)


def Tokens(split: str, **keys: Any) -> TokenWindows:
    """A flat file of token ids, memory-mapped; the last `val_fraction` of it is the validation split. `keys`:
    data=tokens's (`TokensDataConfig`)."""
    data = Settings(**keys)
    if data.dtype not in ("uint16", "uint32"):
        raise ValueError(f"data.dtype={data.dtype} is not supported; use uint16 or uint32")
    file, item = os.path.expanduser(data.path), np.dtype(data.dtype).itemsize
    size = os.path.getsize(file)
    if size % item:
        raise ValueError(
            f"data.path={data.path} holds {size} bytes, not a whole number of {data.dtype} tokens ({item} bytes "
            "each); check data.dtype"
        )
    tokens = _split(_memmap(Path(file), np.dtype(data.dtype)), split, data.val_fraction)
    if len(tokens) < data.seq_len + 1:
        raise ValueError(
            f"data.path={data.path}: its {split} split holds {len(tokens)} tokens, which cannot make one sample of "
            f"data.seq_len={data.seq_len} (+1 for the targets); lower data.seq_len or give a longer file"
            + (", or raise data.val_fraction" if split == "val" else "")
        )
    return TokenWindows(tokens, data.seq_len, data.format, source=Path(file))


class GlobalBatches:
    """Sample indices per optimizer step, from a seeded permutation per epoch: uniform, or the dataset's own
    (`order(seed, epoch)`, a permutation of the seed alone: a token store's, which reads few blocks at a time)."""

    def __init__(self, num_samples: int, global_size: int, seed: int, order: Any = None) -> None:
        self.n, self.global_size, self.seed, self.order = num_samples, global_size, seed, order
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self._permutation(0)  # held from the start: 8 bytes per sample, the same size in every epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            if self.order is None:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                self._perm = np.asarray(self.order(self.seed, epoch), dtype=np.int64)
                if len(self._perm) != self.n:
                    raise ValueError(f"the dataset's epoch_order gave {len(self._perm)} indices for {self.n} samples")
        return self._perm

    def at(self, position: int) -> np.ndarray:
        """The global batch that starts at global sample index `position`."""
        return self.of(np.arange(position, position + self.global_size))

    def of(self, positions: np.ndarray) -> np.ndarray:
        """The sample indices at these global sample indices (a mixture takes any number of them a step)."""
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(positions // self.n):
            mask = positions // self.n == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % self.n]
        return out


def rank_micro_batches(indices: np.ndarray, rank: int, world_size: int, accumulation: int) -> list[np.ndarray]:
    """This rank's K micro-batches of a global batch: rank r owns the r-th contiguous 1/G of it."""
    mine = np.array_split(indices, world_size)[rank]
    return np.array_split(mine, accumulation)


BUILT_IN_DATA = ("launcher.data.builtin.", "launcher.data.text.")
"""The prefixes of the launcher's own data targets: their largest token id is checked before start
(`TokenWindows.largest_id`); batches of any other data are checked as they come (`check_token_ids`)."""


def check_token_ids(batch: Any, vocab: int, step: int) -> None:
    """ValueError (one line: the id, the vocabulary, the step) when a batch's integer `input_ids` (a dict's, or a
    tuple's first tensor) holds an id the model does not embed. Read on the host, before the copy to the device."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(batch, (list, tuple)) and batch:
        ids = batch[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.numel() == 0:
        return
    largest = int(ids.max())
    if largest >= vocab:
        raise ValueError(
            f"token id {largest} in a batch of step {step} is outside the model's vocabulary of {vocab} ids "
            f"(0..{vocab - 1}); fix the data's tokenizer or raise the model's vocab_size to at least {largest + 1}"
        )


SKIP_CHECK = "_check_"
"""`+data._check_=false`: the launcher does not build this dataset before the workers start (a costly one)."""


def build_dataset(data_cfg: Any, split: str) -> Any:
    """The configured dataset of one split: the target called with `split` and its own keys (a data option with a
    `split` key of its own, data=hf's dataset split, is told which one it builds as `role`)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.masked_copy(data_cfg, [k for k in data_cfg if k not in LOADER_KEYS])
    return instantiate(node, **{"role" if "split" in node else "split": split})


LOADER_KEYS = ("workers", "collate", SKIP_CHECK, "val")
"""Keys of a data config node that are the launcher's, never passed to the dataset's target: the loader's processes,
the collate (`launcher.data.collate`), the opt-out of the parent's check, the validation sets (`data.val`)."""
