"""The typed schema of the built-in data groups (conf/data/): `launcher.schema` stores them with the others."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from omegaconf import MISSING

from launcher.ranges import COUNT, FRACTION, SIZE, ranged


class DataFormat(Enum):
    tuple = "tuple"
    """(inputs, next-token targets): the built-in GPT's forward(idx, targets)."""
    hf = "hf"
    """{"input_ids", "labels"}, labels unshifted: a Hugging Face causal LM shifts them itself."""


@dataclass
class PySourceDataConfig:
    _target_: str = "launcher.data.PySource"
    seq_len: int = ranged(128, SIZE)
    val_fraction: float = ranged(0.05, FRACTION)
    format: DataFormat = DataFormat.tuple
    """tuple: (inputs, targets); hf: {input_ids, labels} for a Hugging Face causal LM as it is."""
    workers: int = ranged(0, COUNT, identity=False)
    """DataLoader worker processes reading ahead of the loop (0: read in the loop); the same order either way."""
    packing: bool = True
    """true: files end to end in full windows; false: one sample per file chunk, the last one padded (-100 targets)."""


@dataclass
class SyntheticDataConfig:
    _target_: str = "launcher.data.Synthetic"
    seq_len: int = ranged(128, SIZE)
    vocab_size: int = ranged(256, SIZE)
    num_samples: int = ranged(16384, SIZE)
    format: DataFormat = DataFormat.tuple
    """tuple: (inputs, targets); hf: {input_ids, labels} for a Hugging Face causal LM as it is."""
    workers: int = ranged(0, COUNT, identity=False)
    """DataLoader worker processes reading ahead of the loop (0: read in the loop); the same order either way."""


@dataclass
class TokensDataConfig:
    _target_: str = "launcher.data.Tokens"
    path: str = MISSING
    dtype: str = "uint16"
    seq_len: int = ranged(1024, SIZE)
    val_fraction: float = ranged(0.01, FRACTION)
    format: DataFormat = DataFormat.tuple
    """tuple: (inputs, targets); hf: {input_ids, labels} for a Hugging Face causal LM as it is."""
    workers: int = ranged(0, COUNT, identity=False)
    """DataLoader worker processes reading ahead of the loop (0: read in the loop); the same order either way."""
