"""Built-in data and the global-batch sampler.

The data contract: a data `_target_` is called with `split="train"` or `split="val"` (plus its own
config keys) and returns a map-style dataset whose items collate with `torch.stack` (tuples of
tensors here: inputs and next-token targets).

Which samples an optimizer step sees depends only on the seed and the global batch size, never
on the world size or the accumulation steps: the step that starts at global sample index p
takes positions [p, p+B) of a seeded permutation per epoch, and every (rank, micro-step) takes
a fixed slice of them. A resumed run continues from the sample index its checkpoint recorded.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

FORMATS = ("tuple", "hf")


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array.

    format="tuple": (inputs, next-token targets), for the built-in GPT's forward(idx, targets).
    format="hf": {"input_ids", "labels"} with labels equal to input_ids (unshifted): a Hugging Face causal LM
    shifts its labels itself, so shifting them here too would teach it the token after next.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, format: str = "tuple") -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot make one sample of data.seq_len={seq_len}")
        if format not in FORMATS:
            raise ValueError(f"data.format={format} is not one of {', '.join(FORMATS)}")
        self.tokens, self.seq_len, self.format = tokens, seq_len, format
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        if self.format == "hf":
            inputs = chunk[:-1]
            return {"input_ids": inputs, "labels": inputs.clone()}
        return chunk[:-1], chunk[1:]


def _split(tokens: np.ndarray, split: str, val_fraction: float) -> np.ndarray:
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut] if split == "train" else tokens[cut:]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "launch"


def PySource(split: str, seq_len: int = 128, val_fraction: float = 0.05, format: str = "tuple") -> TokenWindows:
    """Byte-level tokens of the running Python's standard-library .py files.

    Files are assigned to train or validation by a hash of their relative path, so the split is
    deterministic and no file is in both. Built once into a cache file, then memory-mapped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    tag = f"{sys.version_info[0]}.{sys.version_info[1]}-{zlib.crc32(str(root).encode()):08x}-{val_fraction:g}"
    path = cache_dir() / f"pysource-{tag}-{split}.bin"
    if not path.exists():
        _build_pysource(root, val_fraction, path.parent, tag)
    return TokenWindows(np.memmap(path, dtype=np.uint8, mode="r"), seq_len, format)


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
        tmp = out / f".pysource-{tag}-{split}.{os.getpid()}.tmp"
        tmp.write_bytes(b"\n".join(chunks))
        os.replace(tmp, out / f"pysource-{tag}-{split}.bin")  # atomic: ranks may race to build


def Synthetic(
    split: str, seq_len: int = 128, vocab_size: int = 256, num_samples: int = 16384, format: str = "tuple"
) -> TokenWindows:
    """Uniform random tokens from a fixed seed per split."""
    n = num_samples if split == "train" else max(1, num_samples // 10)
    rng = np.random.default_rng(0 if split == "train" else 1)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    return TokenWindows(rng.integers(0, vocab_size, size=n * seq_len + 1, dtype=dtype), seq_len, format)


def Tokens(
    split: str, path: str, dtype: str = "uint16", seq_len: int = 1024, val_fraction: float = 0.01, format: str = "tuple"
) -> TokenWindows:
    """A flat file of token ids, memory-mapped; the last `val_fraction` of it is the validation split."""
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"data.dtype={dtype} is not supported; use uint16 or uint32")
    tokens = np.memmap(os.path.expanduser(path), dtype=np.dtype(dtype), mode="r")
    return TokenWindows(_split(tokens, split, val_fraction), seq_len, format)


class GlobalBatches:
    """Sample indices per optimizer step, from a seeded permutation per epoch."""

    def __init__(self, num_samples: int, global_size: int, seed: int) -> None:
        self.n, self.global_size, self.seed = num_samples, global_size, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perm

    def at(self, position: int) -> np.ndarray:
        """The global batch that starts at global sample index `position`."""
        positions = np.arange(position, position + self.global_size)
        out = np.empty(self.global_size, dtype=np.int64)
        for epoch in np.unique(positions // self.n):
            mask = positions // self.n == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % self.n]
        return out


def rank_micro_batches(indices: np.ndarray, rank: int, world_size: int, accumulation: int) -> list[np.ndarray]:
    """This rank's K micro-batches of a global batch: rank r owns the r-th contiguous 1/G of it."""
    mine = np.array_split(indices, world_size)[rank]
    return np.array_split(mine, accumulation)


def collate(dataset: Dataset, indices: np.ndarray, device: torch.device) -> Any:
    """Stack the samples at `indices` (torch's default_collate) and move them to `device`."""
    return _to_device(default_collate([dataset[int(i)] for i in indices]), device)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
