"""The tokenizer a text source reads with (`data.tokenizer`): loaded from a local folder or a tokenizer.json (no
remote code), its content hashed for the caches keyed by it, its vocabulary and its end-of-document token."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from launcher.base.errors import ConfigError

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
"""Files of a model folder that are no part of its tokenizer (not hashed: a tokenizer beside the weights)."""


def tokenizer_hash(path: Path) -> str:
    """The tokenizer's content: a file's bytes, or every file of its folder but model weights."""
    digest = hashlib.sha256()
    for file in [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()):
        if file.suffix in WEIGHTS:
            continue
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def load_tokenizer(tokenizer: str) -> Any:
    """The tokenizer at a local folder (`AutoTokenizer.from_pretrained`, local files only, no remote code) or a
    tokenizer.json (`PreTrainedTokenizerFast`); ConfigError (one line) when it does not load."""
    path = Path(os.path.expanduser(str(tokenizer)))
    if not path.exists():
        raise ConfigError(
            f"data.tokenizer={tokenizer} does not exist; point it at a local tokenizer folder (what "
            "AutoTokenizer.from_pretrained loads, e.g. a model's folder copied from the Hub) or a tokenizer.json"
        )
    try:
        import transformers

        if path.is_file():
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        message = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(
            f"data.tokenizer={tokenizer} does not load as a tokenizer ({type(e).__name__}: {message}); point it at a "
            "folder AutoTokenizer.from_pretrained loads (tokenizer.json, tokenizer_config.json) or a tokenizer.json"
        ) from e


def tokenizer_vocab(tokenizer: str) -> int:
    """How many ids the tokenizer gives (its vocabulary and added tokens): `data.vocab_size` when left unset."""
    return len(load_tokenizer(tokenizer))


def eos_id(tok: Any, tokenizer: str, eos_token: str | None) -> int:
    """The id of the token that ends each document: data.eos_token, else the tokenizer's own EOS."""
    name = eos_token or tok.eos_token
    if name is None:
        added = ", ".join(str(t) for t in tok.added_tokens_decoder.values()) or "none"
        raise ConfigError(
            f"data.tokenizer={tokenizer} names no EOS token (its added tokens: {added}); name the token that ends a "
            "document with data.eos_token=..."
        )
    if name not in tok.get_vocab():
        raise ConfigError(f"data.eos_token={name} is not a token of data.tokenizer={tokenizer}; name one it has")
    return int(tok.convert_tokens_to_ids(name))
