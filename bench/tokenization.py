"""How fast does data=text tokenize, and how fast does a second launch find the cache?

python bench/tokenization.py [--mb 40] [--vocab 8192] [--workers 0 2]

Generates a corpus of about `--mb` MB of jsonl (seeded random documents of 3 to 600 words, tests/text_corpus.py)
and a byte-level BPE of `--vocab` ids trained on its first 2,000 documents, then builds the token cache the launcher
builds before a run (`launcher.data.text.prepare`: datasets reads the files, datasets.map tokenizes them, the splits are
written), once per `--workers` value (data.tokenize_workers; 0: this process, with the tokenizer's own threads),
each into a fresh cache folder, and once more into the last one (the cache found). Prints tokens per second over the
whole build (read, tokenize, write) and the seconds to find the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the corpus and tokenizer makers

from text_corpus import documents, text_settings, train_tokenizer, write_jsonl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    a = parser.parse_args()

    from launcher.data.text import prepare

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        docs = documents(2_000, words=(3, 600))
        per_doc = sum(len(d) for d in docs) / len(docs)
        count = int(a.mb * 1e6 / per_doc)
        files = [
            write_jsonl(root / "corpus" / f"part-{i:02d}.jsonl", documents(count // 8, seed=i, words=(3, 600)))
            for i in range(8)
        ]
        size = sum(f.stat().st_size for f in files) / 1e6
        tokenizer = train_tokenizer(root / "tokenizer", docs, vocab_size=a.vocab)
        print(
            f"corpus: {len(files)} jsonl files, {size:.1f} MB, {count // 8 * 8:,} documents; tokenizer: "
            f"byte-level BPE of {a.vocab} ids\n"
        )
        print("| data.tokenize_workers | tokens | seconds | tokens/s |")
        print("|---|---|---|---|")
        for workers in a.workers:
            cache = root / f"cache-{workers}"
            with contextlib.redirect_stdout(io.StringIO()):
                folder = prepare(
                    **text_settings(
                        files=[str(root / "corpus")],
                        tokenizer=str(tokenizer),
                        tokenize_workers=workers,
                        cache_dir=str(cache),
                    )
                )
            m = json.loads((folder / "manifest.json").read_text())
            tokens = sum(s["tokens"] for s in m["splits"].values())
            print(f"| {workers} | {tokens:,} | {m['seconds']:.2f} | {m['tokens_per_second']:,.0f} |")
        started = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):
            prepare(**text_settings(files=[str(root / "corpus")], tokenizer=str(tokenizer), cache_dir=str(cache)))
        print(f"\nthe cache found by a second launch: {time.monotonic() - started:.3f} s")


if __name__ == "__main__":
    main()
