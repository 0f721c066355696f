"""Building the token cache of data=text (`launcher.data.text`), in the launcher only: the files read with Hugging Face
`datasets`, tokenized by `datasets.map` (a progress bar; `data.tokenize_workers` processes), the validation documents
chosen, and each split written as token ids and document spans into a folder published whole (`text.publish`)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from launcher.base.errors import ConfigError


class Corpus(Protocol):
    """What the build reads of `launcher.data.text.Corpus` (declared here: the build module does not import its
    caller)."""

    train: tuple[Path, ...]
    val: tuple[Path, ...]
    tokenizer: Path
    settings: dict[str, Any]

    def key(self) -> dict[str, Any]: ...

    @staticmethod
    def reader(path: Path) -> str: ...


class Encode:
    """datasets.map's function: each document's ids as the tokenizer gives them (its own special tokens), and the
    EOS token after them unless they end with it; a document with no text (null, empty, blank) gives none."""

    def __init__(self, tok: Any, eos: int) -> None:
        self.tok, self.eos = tok, eos

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = batch["text"]
        real = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
        ids: list[list[int]] = [[] for _ in texts]
        if real:
            encoded = self.tok(
                [texts[i] for i in real],
                add_special_tokens=True,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )["input_ids"]
            for i, seq in zip(real, encoded):
                ids[i] = seq if seq and seq[-1] == self.eos else [*seq, self.eos]
        return {"ids": ids}


def build(corpus: Corpus, partial: Path, tok: Any, eos: int, workers: int) -> dict[str, Any]:
    """Tokenize the corpus into the folder `partial`; its manifest, for the caller to publish it. datasets' progress
    bars show on a terminal; elsewhere the launcher's one line says what was done."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        return _build(corpus, partial, tok, eos, workers)
    finally:
        if shown:
            datasets.enable_progress_bars()


def _build(corpus: Corpus, partial: Path, tok: Any, eos: int, workers: int) -> dict[str, Any]:
    started, key = time.monotonic(), corpus.key()
    dtype = np.dtype(np.uint16 if len(tok) <= 1 << 16 else np.uint32)  # ids up to 65,535 fit 16 bits
    encode = Encode(tok, eos)
    train = tokenized(corpus.train, corpus, partial, encode, workers, "train")
    lengths = document_lengths(train)
    _check_some_text(lengths, corpus.train, corpus.settings["text_field"], "data.files")
    if corpus.val:
        val = tokenized(corpus.val, corpus, partial, encode, workers, "val")
        _check_some_text(document_lengths(val), corpus.val, corpus.settings["text_field"], "data.val_files")
        splits = {
            "train": write(partial, "train", train, lengths > 0, dtype),
            "val": write(partial, "val", val, document_lengths(val) > 0, dtype),
        }
    else:
        in_val = choose_val(lengths > 0, corpus.settings["val_fraction"], corpus.settings["split_seed"])
        splits = {
            "train": write(partial, "train", train, (lengths > 0) & ~in_val, dtype),
            "val": write(partial, "val", train, in_val, dtype),
        }
    skipped = int((lengths == 0).sum()) + (int((document_lengths(val) == 0).sum()) if corpus.val else 0)
    del train
    shutil.rmtree(partial / "hf", ignore_errors=True)  # datasets' own arrow files: read, no longer needed
    if corpus.key() != key:
        raise ConfigError("data.files changed while they were tokenized; launch again once they are written")
    seconds = time.monotonic() - started
    tokens = sum(s["tokens"] for s in splits.values())
    manifest = {
        "format": key["format"],
        "key": key,
        "dtype": dtype.name,
        "tokenizer": str(corpus.tokenizer),
        "vocab_size": len(tok),
        "eos_id": eos,
        "splits": splits,
        "skipped_documents": skipped,
        "seconds": round(seconds, 3),
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "tokenize_workers": workers,
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return manifest


def _check_some_text(lengths: np.ndarray, paths: tuple[Path, ...], field: str, key: str) -> None:
    """ConfigError naming the files when not one of their documents has text (each empty, blank, or without a
    `field` value): not a corpus of 0 tokens."""
    if (lengths > 0).any():
        return
    shown = ", ".join(map(str, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    raise ConfigError(
        f"{key}: every one of the {len(lengths)} document(s) in {shown} is empty, blank or has no {field!r} value: "
        "no token to train on; point it at files with text, or name the field that holds it with data.text_field=..."
    )


def tokenized(paths: tuple[Path, ...], corpus: Corpus, partial: Path, encode: Encode, workers: int, name: str) -> Any:
    """The files read (each kind by its `datasets` builder, in the order the kinds first appear), their text column
    as `text`, mapped to `ids`: one row per document, in file and row order."""
    from datasets import Dataset, Features, List, Value, concatenate_datasets

    field, hf = corpus.settings["text_field"], partial / "hf"
    kinds: dict[str, list[Path]] = {}
    for path in paths:
        kinds.setdefault(corpus.reader(path), []).append(path)
    parts: list[Dataset] = []
    for kind, group in kinds.items():
        try:
            read = _read(kind, group, field, corpus.settings["txt_sample_by"], hf)
        except ConfigError:
            raise
        except Exception as e:
            message = " ".join(str(e).split())[:300]
            raise ConfigError(f"data.files: the {kind} files ({group[0]}, ...) do not read: {message}") from e
        column = "text" if kind == "text" else field  # a txt file's lines are the `text` builder's column
        for part in read:
            part = part.select_columns([column])
            parts.append(part if column == "text" else part.rename_column(column, "text"))
    text = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    return text.map(
        encode,
        batched=True,
        num_proc=workers or None,
        remove_columns=["text"],
        features=Features({"ids": List(Value("int32"))}),
        cache_file_name=str(hf / f"{name}-ids.arrow"),  # never beside a saved dataset of the user's
        desc=f"launch: tokenizing the {name} documents",
    )


def _read(kind: str, group: list[Path], field: str, sample_by: str, hf: Path) -> list[Any]:
    """The files of one kind as datasets: save_to_disk folders one by one (a DatasetDict's train split), the others
    together by their builder, its arrow files under `hf`."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    if kind != "saved":
        options = {"text": {"sample_by": sample_by}, "parquet": {"columns": [field]}}.get(kind, {})
        return [load_dataset(kind, data_files=[str(p) for p in group], split="train", cache_dir=str(hf), **options)]
    parts = []
    for path in group:
        saved = load_from_disk(str(path))
        if isinstance(saved, DatasetDict):
            if "train" not in saved:
                raise ConfigError(f"data.files: {path} holds the splits {', '.join(saved)} and no train split")
            saved = saved["train"]
        parts.append(saved)
    return parts


def check_field(path: Path, kind: str | None, field: str) -> None:
    """ConfigError naming the fields a file of `kind` (its reader) has when the text field is not one of them (txt
    files are text)."""
    if kind == "text":
        return
    try:
        if kind == "json":
            import fsspec

            with fsspec.open(str(path), "rt", compression="infer") as f:
                line = next((line for line in f if line.strip()), "")
            record = json.loads(line) if line.lstrip().startswith("{") else None
            names = list(record) if isinstance(record, dict) else None
        elif kind == "parquet":
            import pyarrow.parquet as pq

            if isinstance(path, Path):
                names = pq.read_schema(path).names
            else:  # in object storage
                with path.open() as f:
                    names = pq.read_schema(f).names
        elif kind == "arrow":
            import pyarrow as pa

            try:
                names = pa.ipc.open_stream(str(path)).schema.names
            except pa.ArrowInvalid:
                names = pa.ipc.open_file(str(path)).schema.names
        else:
            from datasets import load_from_disk

            saved = load_from_disk(str(path))
            names = saved.column_names if not isinstance(saved.column_names, dict) else saved["train"].column_names
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"data.files: {path} does not read as {kind} ({type(e).__name__}: {e})") from e
    if names is not None and field not in names:
        raise ConfigError(
            f"data.files: {path} has no field {field!r} (its fields: {', '.join(map(str, names)) or 'none'}); "
            "name the one that holds the text with data.text_field=..."
        )


def document_lengths(ids: Any) -> np.ndarray:
    """Tokens per document (0: one with no text)."""
    import pyarrow.compute as pc

    column = ids.data.column("ids")
    return np.concatenate([np.asarray(pc.list_value_length(c), dtype=np.int64) for c in column.chunks] or [[]])


def choose_val(real: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Which documents are validation: round(fraction x documents) of those with text (one at least, when the
    fraction is not 0 and there are two), drawn by a permutation seeded by `seed`."""
    docs = np.flatnonzero(real)
    count = int(round(len(docs) * fraction))
    if fraction > 0 and count == 0 and len(docs) > 1:
        count = 1
    chosen = np.zeros(len(real), dtype=bool)
    chosen[docs[np.random.default_rng(seed).permutation(len(docs))[:count]]] = True
    return chosen


def write(partial: Path, name: str, ids: Any, keep: np.ndarray, dtype: np.dtype) -> dict[str, int]:
    """The kept documents' ids end to end into `<name>.bin`, and their [begin, end) spans into `<name>.spans.npy`,
    one arrow chunk at a time (bounded memory on any corpus)."""
    import pyarrow.compute as pc

    spans, offset, row = [], 0, 0
    with open(partial / f"{name}.bin", "wb") as f:
        for chunk in ids.data.column("ids").chunks:
            lengths = np.asarray(pc.list_value_length(chunk), dtype=np.int64)
            mine = keep[row : row + len(chunk)]
            row += len(chunk)
            values = np.asarray(chunk.flatten())[np.repeat(mine, lengths)]
            f.write(values.astype(dtype).tobytes())
            ends = offset + np.cumsum(lengths[mine])
            spans.append(np.stack([ends - lengths[mine], ends], axis=1))
            offset = int(ends[-1]) if len(ends) else offset
    np.save(partial / f"{name}.spans.npy", np.concatenate(spans) if spans else np.empty((0, 2), dtype=np.int64))
    return {"documents": int(keep.sum()), "tokens": offset}
