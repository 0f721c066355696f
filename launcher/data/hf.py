"""data=hf: a Hugging Face dataset as it is, read through `datasets.load_dataset` (the defaults of `HF` and `prepare`
are the schema's, launcher/config/data_schema.py: `HFDataConfig`).

`data.path` is what `load_dataset` takes: a builder with `data.data_files` (json, parquet, csv, text), a folder of
such files (a snapshot folder of the local Hub cache among them), or a Hub id (with `HF_DATASETS_OFFLINE=1`, what
`datasets` cached of it); `data.name` its
configuration, `data.split` the split to train on. The validation samples are `data.val_split`, or else
`data.val_fraction` of the training split, drawn by `data.split_seed` (`train_test_split`: the same rows every time).
`data.streaming=true` gives a stream (`datasets.IterableDataset`), drawn in its own order (`launcher.data.sources`).

With `data.tokenizer`, each row's `data.text_field` is tokenized (`data.max_length`: truncated there), the text field
dropped: for a map-style dataset once, in the launcher before any worker starts (`prepare`), into a cache folder
(`data.cache_dir`, default ~/.cache/launch/hf) named by the hash of the dataset's fingerprint, the tokenizer's bytes
and the settings, which the workers load (memory-mapped arrow files); for a stream, lazily, as each rank reads it.
`data.columns` keeps only the named fields. Rows go to the run's collate (`data.collate`), or to the default one,
which turns lists of numbers into tensors and refuses any other field, naming it (`launcher.data.collate`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from launcher.base.errors import ConfigError
from launcher.base.settings import Settings
from launcher.data.builtin import cache_dir as launch_cache


def HF(role: str, **keys: Any) -> Any:
    """The `role` ("train" or "val") of the dataset: a `datasets.Dataset`, or a `datasets.IterableDataset` when
    streaming. `keys`: data=hf's (`HFDataConfig`). (A data option with a `split` key of its own is called with the
    launcher's `role=`.)"""
    reader = _Reader(keys)
    data = reader.data
    if data.streaming:
        return reader.stream(role)
    if data.tokenizer is None:
        return reader.select(reader.rows(role))
    import datasets

    folder = reader.cached()
    if folder is None:
        raise RuntimeError(
            f"no tokenized cache of data.path={data.path} at {reader.folder()}: the launcher makes it before the "
            "workers start; the dataset or the tokenizer changed since, launch again"
        )
    return datasets.load_from_disk(str(folder / role))


def prepare(**keys: Any) -> None:
    """In the launcher, before any worker starts: the dataset loaded once (datasets caches its arrow files), its
    splits and fields checked (ConfigError naming the ones it has), and a map-style dataset tokenized once into the
    cache, found there the next time (one line says which). `keys`: data=hf's (`HFDataConfig`)."""
    reader = _Reader(keys)
    data = reader.data
    if data.streaming:
        first = next(iter(reader.load(data.split, True)), None)
        if first is not None:
            reader.check_fields(list(first), data.split)
        return
    rows = reader.rows("train")
    reader.check_fields(rows.column_names, data.split)
    if data.tokenizer is None:
        reader.rows("val") if data.val_split else None  # its split checked here, not in the workers
        return
    if reader.cached() is not None:
        print(
            f"launch: data: found the tokenized rows of data.path={data.path} in the cache {reader.folder()}",
            flush=True,
        )
        return
    reader.tokenize_into_cache()


HF.prepare = prepare  # type: ignore[attr-defined]  # what the launcher runs once before the workers start


class _Reader:
    """One data=hf configuration (`data`: its settings), and what it reads."""

    def __init__(self, keys: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        data_files, columns = keys.get("data_files"), keys.get("columns")
        if OmegaConf.is_config(data_files):  # as Hydra hands it to the target: datasets wants plain values
            data_files = OmegaConf.to_container(data_files)
        self.data = Settings(**keys | {"data_files": data_files, "columns": list(columns) if columns else None})

    def load(self, split: str, streaming: bool) -> Any:
        """`load_dataset` of one split; ConfigError (one line) for a path, configuration or split it does not find.
        datasets' progress bars show on a terminal only."""
        import sys

        import datasets

        if not sys.stderr.isatty():
            datasets.disable_progress_bars()
        try:
            return datasets.load_dataset(
                self.data.path, self.data.name, split=split, data_files=self.data.data_files, streaming=streaming
            )
        except ValueError as e:
            if "Unknown split" not in str(e):
                raise _failed(self, e) from e
            key = "data.split" if split == self.data.split else "data.val_split"
            raise ConfigError(
                f"{key}={split} is not a split of data.path={self.data.path}: it has {self._splits()}"
            ) from e
        except Exception as e:
            raise _failed(self, e) from e

    def _splits(self) -> str:
        import datasets

        try:
            return ", ".join(
                datasets.get_dataset_split_names(self.data.path, self.data.name, data_files=self.data.data_files)
            )
        except Exception:
            return "other splits"

    def rows(self, role: str) -> Any:
        """The map-style rows of `role`: its split, or its part of the training split."""
        if self.data.val_split:
            return self.load(self.data.val_split if role == "val" else self.data.split, False)
        parts = self.load(self.data.split, False).train_test_split(
            test_size=self.data.val_fraction, seed=self.data.split_seed
        )
        return parts["test" if role == "val" else "train"]

    def stream(self, role: str) -> Any:
        """The stream of `role` (a stream has no length to carve a fraction from: validation is its own split)."""
        if role == "val" and not self.data.val_split:
            raise ConfigError(
                f"data.streaming=true: data.path={self.data.path} has no validation split to draw from a stream; name "
                "one (data.val_split=...) or set trainer.eval_every=0"
            )
        rows = self.load(self.data.val_split if role == "val" else self.data.split, True)
        if self.data.tokenizer is not None:
            from launcher.data.tokenizer import load_tokenizer

            encode = _Encode(load_tokenizer(self.data.tokenizer), self.data.text_field, self.data.max_length)
            rows = rows.map(encode, batched=True, remove_columns=[self.data.text_field])
        return self.select(rows)

    def select(self, rows: Any) -> Any:
        return rows.select_columns(self.data.columns) if self.data.columns else rows

    def check_fields(self, fields: list[str], split: str) -> None:
        """data.text_field (with a tokenizer) and data.columns name fields the rows have."""
        wanted = ([self.data.text_field] if self.data.tokenizer else []) + [
            c for c in self.data.columns or [] if not self.data.tokenizer or c not in ("input_ids", "attention_mask")
        ]
        missing = [f for f in wanted if f not in fields]
        if missing:
            key = "data.text_field" if missing[0] == self.data.text_field and self.data.tokenizer else "data.columns"
            raise ConfigError(
                f"{key}: the rows of data.path={self.data.path} (split {split}) have no field {missing[0]!r}; they "
                f"have {', '.join(fields)}"
            )

    def key(self) -> dict[str, Any]:
        """Everything the tokenized rows depend on: the cache folder is named by its hash."""
        from launcher.data.tokenizer import tokenizer_hash

        base = self.rows("train")
        return {
            "format": 1,
            "rows": [base._fingerprint, self.load(self.data.val_split, False)._fingerprint]
            if self.data.val_split
            else [base._fingerprint],
            "split": [self.data.split, self.data.val_split, self.data.val_fraction, self.data.split_seed],
            "tokenizer": tokenizer_hash(Path(os.path.expanduser(str(self.data.tokenizer)))),
            "text_field": self.data.text_field,
            "max_length": self.data.max_length,
            "columns": self.data.columns,
        }

    def folder(self, key: dict[str, Any] | None = None) -> Path:
        digest = hashlib.sha256(json.dumps(key or self.key(), sort_keys=True).encode()).hexdigest()[:24]
        root = Path(os.path.expanduser(self.data.cache_dir)) if self.data.cache_dir else launch_cache() / "hf"
        return root / digest

    def cached(self) -> Path | None:
        """The cache folder of these rows, when a complete one is there (its manifest, written last, names its key)."""
        key = self.key()
        folder = self.folder(key)
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return folder if manifest.get("key") == json.loads(json.dumps(key)) else None

    def tokenize_into_cache(self) -> None:
        """Tokenize both roles' rows with datasets.map, save them, write the manifest last, publish by rename."""
        import time

        from launcher.base.durable import write_durably
        from launcher.data.text import partial_folder
        from launcher.data.tokenizer import load_tokenizer

        key = self.key()
        folder, started = self.folder(key), time.monotonic()
        encode = _Encode(load_tokenizer(str(self.data.tokenizer)), self.data.text_field, self.data.max_length)
        partial = partial_folder(folder)
        try:
            counts = {}
            for role in ("train", "val"):
                rows = self.rows(role).map(encode, batched=True, remove_columns=[self.data.text_field])
                self.select(rows).save_to_disk(str(partial / role))
                counts[role] = len(rows)
            write_durably(partial / "manifest.json", json.dumps({"key": key, "rows": counts}))
            if folder.exists():
                shutil.rmtree(folder)  # an incomplete one (no manifest of this key)
            os.rename(partial, folder)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        print(
            f"launch: data: tokenized {counts['train']:,} train and {counts['val']:,} validation rows of "
            f"data.path={self.data.path} in {time.monotonic() - started:.1f} s into the cache {folder}",
            flush=True,
        )


class _Encode:
    """datasets.map's function: the text field's token ids (and attention mask), truncated at `max_length`."""

    def __init__(self, tok: Any, field: str, max_length: int | None) -> None:
        self.tok, self.field, self.max_length = tok, field, max_length

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, Any]:
        texts = [t if isinstance(t, str) else "" for t in batch[self.field]]
        truncate = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        return dict(self.tok(texts, return_token_type_ids=False, **truncate))


def _failed(reader: _Reader, e: BaseException) -> ConfigError:
    message = " ".join(str(e).split())[:300] or type(e).__name__
    where = f"data.path={reader.data.path}" + (f" data.name={reader.data.name}" if reader.data.name else "")
    files = f" data.data_files={reader.data.data_files}" if reader.data.data_files else ""
    return ConfigError(
        f"{where}{files} does not load ({type(e).__name__}: {message}); give a local folder or files (e.g. "
        "data.path=json data.data_files=train.jsonl), or a snapshot folder of the local Hub cache"
    )
