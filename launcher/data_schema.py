"""The typed schema of the built-in data groups (conf/data/): `launcher.schema` stores them with the others."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING

from launcher.ranges import COUNT, FRACTION, SIZE, launch_only, ranged


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


@dataclass
class TextDataConfig:
    """data=text: your text files and your tokenizer, tokenized once in the launcher into a cache (launcher/text.py)."""

    _target_: str = "launcher.text.Text"
    files: Any = MISSING
    """A path or glob, or a list of them: jsonl/json, parquet, txt, arrow files, folders of them, or a folder written
    by save_to_disk."""
    tokenizer: str = MISSING
    """A local folder AutoTokenizer.from_pretrained loads (a model's folder copied from the Hub), or tokenizer.json."""
    text_field: str = "text"
    """The field (column) that holds each document's text; txt files are text."""
    val_files: Any = None
    """The validation documents' files (as data.files); unset: data.val_fraction of the documents, by split_seed."""
    val_fraction: float = ranged(0.01, FRACTION)
    split_seed: int = ranged(0, COUNT)
    eos_token: str | None = None
    """The token after each document; unset: the tokenizer's EOS token."""
    txt_sample_by: str = "document"
    """One document of a txt file: the whole file (document), a block between blank lines (paragraph), or a line."""
    vocab_size: int = "${launch_vocab:${data.tokenizer}}"  # type: ignore[assignment]
    """The ids the model must embed: the tokenizer's (its vocabulary and added tokens) unless set higher; the built-in
    GPT's model.vocab_size follows it."""
    seq_len: int = ranged(1024, SIZE)
    packing: bool = True
    """true: documents end to end, an EOS after each, in full windows; false: one sample per document chunk, the last
    one padded (-100 targets)."""
    format: DataFormat = DataFormat.tuple
    """tuple: (inputs, targets); hf: {input_ids, labels} for a Hugging Face causal LM as it is."""
    workers: int = ranged(0, COUNT, identity=False)
    """DataLoader worker processes reading ahead of the loop (0: read in the loop); the same order either way."""
    tokenize_workers: int = ranged(0, COUNT, identity=False)
    """Processes datasets.map tokenizes in (0: this one, with the tokenizer's own threads)."""
    cache_dir: str | None = launch_only(None)
    """Where the token caches are kept; unset: ~/.cache/launch/text (XDG_CACHE_HOME)."""


def tokenizer_vocab(tokenizer: str) -> int:
    """The resolver `${launch_vocab:PATH}`: the ids the tokenizer at PATH gives (transformers imported only here)."""
    from launcher.text import tokenizer_vocab as vocab

    return vocab(tokenizer)
