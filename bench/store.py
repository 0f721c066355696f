"""A token store (data=store) against the local data=text cache, on a corpus generated here.

python bench/store.py [--megabytes 200] [--steps 40] [--repeats 3]

1. Generates `--megabytes` of jsonl text (8 files of seeded random words) and a byte-level BPE of 8,192 ids.
2. `launch prepare` builds the store into a local folder with data.tokenize_workers=1 and =2: tokens/s of each.
3. The same build into S3 (moto's server on loopback, started here).
4. Training runs through the real `launch` (the built-in GPT, 4 x 128, sequence 256, micro-batch 8 x accumulation 2 x
   2 CPU ranks = global 32, logger=none), each the median logged step time after the first step and samples/s:
   data=text from its local cache (built first, untimed), data=store from S3 with a cold cache, and again with the
   cache the cold run left (warm). Ratios are against data=text, measured in this invocation.
   Goal: warm <= 1.05 x data=text; the cold one said with its cause.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = str(Path(sys.executable).parent / "launch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def corpus(root: Path, megabytes: int) -> tuple[Path, Path]:
    from text_corpus import documents, train_tokenizer

    files = root / "corpus"
    files.mkdir(parents=True)
    per_file, written, seed = megabytes * 1_000_000 // 8, 0, 0
    for i in range(8):
        with open(files / f"part-{i}.jsonl", "w") as f:
            size = 0
            while size < per_file:
                seed += 1
                for doc in documents(200, seed=seed, words=(20, 400)):
                    line = json.dumps({"text": doc}) + "\n"
                    f.write(line)
                    size += len(line)
            written += size
    tokenizer = train_tokenizer(root / "tokenizer", documents(3000, seed=0), vocab_size=8192)
    print(f"corpus: {written / 1e6:.0f} MB of jsonl in 8 files", flush=True)
    return files, tokenizer


def prepare(files: Path, tokenizer: Path, out: str, workers: int, env: dict[str, str]) -> float:
    """tokens/s of one build (as `launch prepare` reports it)."""
    proc = subprocess.run(
        [
            LAUNCH,
            "prepare",
            "data=text",
            f"data.files={files}",
            f"data.tokenizer={tokenizer}",
            f"out={out}",
            f"data.tokenize_workers={workers}",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode:
        sys.exit(f"prepare failed:\n{proc.stderr[-2000:]}")
    line = next(line for line in proc.stdout.splitlines() if "tokens/s" in line)
    return float(line.split(" tokens at ")[1].split(" tokens/s")[0].replace(",", ""))


def train(name: str, data: list[str], steps: int, out: Path, env: dict[str, str]) -> tuple[float, float]:
    overrides = [
        "model=gpt_tiny",
        "batch.micro_size=8",
        "batch.global_size=32",
        "gpus=2",
        "device=cpu",
        "data.seq_len=256",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "logger=none",
        "trainer.progress=false",
        "trainer.save_at_end=false",
        *data,
        f"hydra.run.dir={out / name}",
    ]
    proc = subprocess.run([LAUNCH, *overrides], capture_output=True, text=True, env=env, cwd=out)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()][1:]
    return statistics.median(r["step_time_s"] for r in rows), statistics.median(r["samples_per_s"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megabytes", type=int, default=200)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files, tokenizer = corpus(root, a.megabytes)
        one = prepare(files, tokenizer, str(root / "store-1"), 1, env)
        two = prepare(files, tokenizer, str(root / "store-2"), 2, env)
        began = time.monotonic()
        prepare(files, tokenizer, "s3://bench/tokens", 2, env)
        to_s3 = time.monotonic() - began
        text = [
            "data=text",
            f"data.files={files}",
            f"data.tokenizer={tokenizer}",
            f"data.cache_dir={root / 'text'}",
            "data.val_fraction=0.01",
        ]
        subprocess.run(
            [
                LAUNCH,
                *text,
                "trainer.max_steps=1",
                "logger=none",
                "gpus=1",
                "device=cpu",
                f"hydra.run.dir={root / 'warmup'}",
            ],
            capture_output=True,
            env=env,
            cwd=root,
        )
        # Each `--repeats` times, interleaved (a machine's load drifts), the fastest median kept; each cold run with
        # an empty cache of its own, its warm run after it with what it left.
        runs: dict[str, list[tuple[float, float]]] = {"text": [], "cold": [], "warm": []}
        for r in range(a.repeats):
            store = [
                "data=store",
                "data.url=s3://bench/tokens",
                f"data.cache_dir={root / f'cache-{r}'}",
                "data.cache_limit=2GB",
            ]
            runs["text"].append(train(f"text-{r}", text, a.steps, root, env))
            runs["cold"].append(train(f"cold-{r}", store, a.steps, root, env))
            runs["warm"].append(train(f"warm-{r}", store, a.steps, root, env))
        local, cold, warm = (min(runs[k]) for k in ("text", "cold", "warm"))
    server.stop()
    print(
        f"\nbuild: {one:,.0f} tokens/s with 1 worker, {two:,.0f} with 2 ({two / one:.2f}x); into S3 with 2: "
        f"{to_s3:.1f} s\n"
    )
    print("| data | step time (s) | samples/s | x data=text |")
    print("|---|---|---|---|")
    for name, (t, rate) in (
        ("data=text, local cache", local),
        ("data=store on S3, cold cache", cold),
        ("data=store on S3, warm cache", warm),
    ):
        print(f"| {name} | {t:.4f} | {rate:.0f} | {t / local[0]:.3f} |")


if __name__ == "__main__":
    main()
