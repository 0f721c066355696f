"""A corpus and a tokenizer made on the spot, with no download: documents of seeded random words (of varying
lengths), written as jsonl and parquet files, and a byte-level BPE trained on them with `tokenizers`, saved as a
folder AutoTokenizer loads. For tests/test_text_data.py and bench/tokenization.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches; def return "
    "import class lambda yield 0 1 2 3 42 == != ( ) [ ] { } : , . ' \" ünïcödé naïve café"
).split()


def documents(count: int, seed: int = 0, words: tuple[int, int] = (3, 120)) -> list[str]:
    """`count` documents of `words` random words each (lines of about ten words)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        n = rng.randint(*words)
        chosen = [rng.choice(WORDS) for _ in range(n)]
        docs.append("\n".join(" ".join(chosen[i : i + 10]) for i in range(0, n, 10)))
    return docs


def train_tokenizer(folder: Path, texts: list[str], vocab_size: int = 320, pad: bool = False) -> Path:
    """A byte-level BPE of `vocab_size` ids (EOS among them) trained on `texts`, saved with save_pretrained into
    `folder` (tokenizer.json and tokenizer_config.json); the folder. `pad`: EOS is its padding token too (what a
    collate that pads needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    pad_token = {"pad_token": EOS} if pad else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, **pad_token).save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path)
    return path


def make_corpus(root: Path, count: int = 240) -> dict[str, Path]:
    """Under `root`: `tokenizer/` (a folder AutoTokenizer loads), `corpus/a.jsonl` and `corpus/b.parquet` (half the
    documents each), and `val.jsonl` (other documents)."""
    docs = documents(count)
    return {
        "tokenizer": train_tokenizer(root / "tokenizer", docs),
        "jsonl": write_jsonl(root / "corpus" / "a.jsonl", docs[: count // 2]),
        "parquet": write_parquet(root / "corpus" / "b.parquet", docs[count // 2 :]),
        "val": write_jsonl(root / "val.jsonl", documents(24, seed=1)),
        "corpus": root / "corpus",
    }


def text_settings(**given: object) -> dict[str, object]:
    """data=text's keys as its schema sets them (`Text` and `prepare` take no defaults of their own), `given` over
    them: what a run passes, for calling them outside one."""
    import dataclasses

    from launcher.config.data_schema import TextDataConfig
    from launcher.data.builtin import LOADER_KEYS

    plain = {
        f.name: f.default
        for f in dataclasses.fields(TextDataConfig)
        if f.name != "_target_" and f.name not in LOADER_KEYS
    }
    return plain | {"vocab_size": None, "format": "tuple"} | given  # the tokenizer's vocabulary; the enum's name
