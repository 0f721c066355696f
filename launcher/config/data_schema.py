"""The typed schema of the built-in data groups (conf/data/): `launcher.config.schema` stores them with the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from launcher.config.ranges import COUNT, FRACTION, SIZE, launch_only, ranged


@dataclass
class CollateConfig:
    """data.collate: the collate of a rank's micro-batch (launcher/data/collate.py). data.collate._target_=a function,
    or a class built with its own keys (+data.collate.KEY=VALUE, nested targets too: a tokenizer); unset: torch's
    default_collate, lists of numbers made tensors first."""

    _target_: str | None = None


class DataFormat(Enum):
    tuple = "tuple"
    """(inputs, next-token targets): the built-in GPT's forward(idx, targets)."""
    hf = "hf"
    """{"input_ids", "labels"}, labels unshifted: a Hugging Face causal LM shifts them itself."""


# The fields every data option declares alike, each written once with its meaning (`launcher.config.reference`).


def data_format() -> Any:
    return field(
        default=DataFormat.tuple,
        metadata={"doc": "tuple: (inputs, targets); hf: {input_ids, labels} for a Hugging Face causal LM as it is."},
    )


def loader_workers() -> Any:
    return ranged(
        0,
        COUNT,
        identity=False,
        doc="DataLoader worker processes reading ahead of the loop (0: read in the loop); the same order either way.",
    )


def micro_batch_collate() -> Any:
    return field(
        default_factory=CollateConfig,
        metadata={"doc": "The collate of a rank's micro-batch (launcher/data/collate.py)."},
    )


def validation_sets() -> Any:
    return launch_only(
        factory=dict,
        doc="Several validation sets, each under its name (logged as val/<name>/loss, "
        "val/<name>/<metric>): a data node of any source (`_target_` and its keys), or keys merged over "
        "this one (`+data.val.short.seq_len=64`); unset: the validation split of this data alone "
        "(val_loss, val/<metric>).",
    )


@dataclass
class _LoaderKeys:
    """The keys the built-in data options of files and arrays take alike (their fields come first in the config)."""

    _target_: str = MISSING
    format: DataFormat = data_format()
    workers: int = loader_workers()
    collate: CollateConfig = micro_batch_collate()
    val: dict[str, Any] = validation_sets()


@dataclass
class PySourceDataConfig(_LoaderKeys):
    _target_: str = "launcher.data.builtin.PySource"
    seq_len: int = ranged(128, SIZE)
    val_fraction: float = ranged(0.05, FRACTION)
    packing: bool = True
    """true: files end to end in full windows; false: one sample per file chunk, the last one padded (-100 targets)."""


@dataclass
class SyntheticDataConfig(_LoaderKeys):
    _target_: str = "launcher.data.builtin.Synthetic"
    seq_len: int = ranged(128, SIZE)
    vocab_size: int = ranged(256, SIZE)
    num_samples: int = ranged(16384, SIZE)


@dataclass
class TokensDataConfig(_LoaderKeys):
    _target_: str = "launcher.data.builtin.Tokens"
    path: str = MISSING
    dtype: str = "uint16"
    seq_len: int = ranged(1024, SIZE)
    val_fraction: float = ranged(0.01, FRACTION)


@dataclass
class TextDataConfig:
    """data=text: your text files and your tokenizer, tokenized once in the launcher into a cache
    (launcher/data/text.py)."""

    _target_: str = "launcher.data.text.Text"
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
    format: DataFormat = data_format()
    workers: int = loader_workers()
    collate: CollateConfig = micro_batch_collate()
    val: dict[str, Any] = validation_sets()
    tokenize_workers: int = ranged(0, COUNT, identity=False)
    """Processes datasets.map tokenizes in (0: this one, with the tokenizer's own threads)."""
    cache_dir: str | None = launch_only(None)
    """Where the token caches are kept; unset: ~/.cache/launch/text (XDG_CACHE_HOME)."""


@dataclass
class CustomDataConfig:
    """data=custom: a target of your own (called with split="train" or "val" and the keys you add with
    +data.KEY=VALUE; +data.workers=N: DataLoader processes), and its collate."""

    _target_: str = MISSING
    collate: CollateConfig = micro_batch_collate()
    val: dict[str, Any] = validation_sets()


@dataclass
class HFDataConfig:
    """data=hf: a Hugging Face dataset as it is, through datasets.load_dataset (launcher/data/hf.py)."""

    _target_: str = "launcher.data.hf.HF"
    path: str = MISSING
    """What load_dataset takes: a builder (json, parquet, csv, text) with data.data_files, a folder of such files, or
    a snapshot folder of the local Hub cache (hub/datasets--ORG--NAME/snapshots/REVISION)."""
    name: str | None = None
    """The dataset's configuration (load_dataset's name)."""
    split: str = "train"
    """The split to train on."""
    val_split: str | None = None
    """The validation split; unset: data.val_fraction of the training split, drawn by data.split_seed."""
    val_fraction: float = ranged(0.01, FRACTION)
    split_seed: int = ranged(0, COUNT)
    data_files: Any = None
    """load_dataset's data_files: a path, a glob, a list, or a dict of split -> files."""
    streaming: bool = False
    """true: a stream (datasets.IterableDataset), read in its own order, resumed from its state_dict."""
    tokenizer: str | None = None
    """A local tokenizer folder (or tokenizer.json): data.text_field tokenized, once and cached (a stream: as read)."""
    text_field: str = "text"
    max_length: int | None = ranged(None, SIZE)
    """Token ids per row at most (truncation); unset: none."""
    columns: list[str] | None = None
    """The fields each row keeps (after tokenization); unset: all of them."""
    workers: int = ranged(0, COUNT, identity=False)
    """DataLoader worker processes reading ahead of the loop (0: read in the loop; a stream: at most one reader); the
    same order either way."""
    collate: CollateConfig = micro_batch_collate()
    val: dict[str, Any] = validation_sets()
    cache_dir: str | None = launch_only(None)
    """Where tokenized rows are kept; unset: ~/.cache/launch/hf (XDG_CACHE_HOME)."""


@dataclass
class StoreDataConfig:
    """data=store: a token store `launch prepare` built, in a folder or at an fsspec URL (launcher/data/store.py)."""

    _target_: str = "launcher.data.store.Store"
    url: str = MISSING
    """The store: a local folder, or a URL (s3://bucket/tokens); credentials come from the environment."""
    seq_len: int = ranged(1024, SIZE)
    packing: bool = True
    """true: each shard's documents end to end, an EOS after each, in full windows; false: one sample per document
    chunk, the last one padded (-100 targets)."""
    format: DataFormat = data_format()
    vocab_size: int = "${launch_store_vocab:${data.url}}"  # type: ignore[assignment]
    """The ids the model must embed: the store's tokenizer's unless set higher; the built-in GPT's follows it."""
    tokenizer: str | None = None
    """The tokenizer the run expects: refused if the store was built with another one."""
    shuffle_blocks: int = ranged(16, SIZE)
    """Groups of samples that share a block, permuted together: the samples of this many are shuffled among
    themselves (more: a finer shuffle, more blocks read at a time)."""
    workers: int = ranged(2, COUNT, identity=False)
    """DataLoader processes per rank reading ahead of the loop (their fetches run while the step trains)."""
    collate: CollateConfig = micro_batch_collate()
    val: dict[str, Any] = validation_sets()
    cache_dir: str | None = launch_only(None)
    """Where a remote store's blocks are cached on each node; unset: ~/.cache/launch/store."""
    cache_limit: Any = launch_only("10GB")
    """The most the cache holds (bytes, or 500MB, 20GB): the least recently read blocks are evicted first."""


def tokenizer_vocab(tokenizer: str) -> int:
    """The resolver `${launch_vocab:PATH}`: the ids the tokenizer at PATH gives (transformers imported only here)."""
    from launcher.data.tokenizer import tokenizer_vocab as vocab

    return vocab(tokenizer)


def store_vocab(url: str) -> int:
    """The resolver `${launch_store_vocab:URL}`: the ids of the store's tokenizer, from its manifest
    (launcher/data/store.py imported only here)."""
    from launcher.data.store import store_vocab as vocab

    return vocab(url)
