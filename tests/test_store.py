"""data=store: a token store in shards, built by `launch prepare` (in parts, resumable), read from a local folder or
from S3 (moto's server on loopback) through a bounded cache, every block verified, in the batch contract's order.

The corpus and tokenizer are made on the spot (tests/text_corpus.py); nothing is downloaded.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env, cli_here, launch, launch_here
from object_store import SECRET, s3_server
from text_corpus import documents, train_tokenizer, write_jsonl

from launcher.data.store import Store, StoreError

TINY = [
    "model=gpt_tiny",
    "model.n_layer=1",
    "model.n_embd=32",
    "logger=none",
    "device=cpu",
    "trainer.progress=false",
    "trainer.log_every=1",
    "batch.global_size=16",
    "batch.micro_size=4",
]


def _corpus(root: Path, files: int = 3, per_file: int = 60) -> dict[str, Path]:
    """`files` jsonl files of seeded random documents, and a byte-level BPE trained on them."""
    for i in range(files):
        write_jsonl(root / "corpus" / f"part-{i}.jsonl", documents(per_file, seed=10 + i))
    return {"corpus": root / "corpus", "tokenizer": train_tokenizer(root / "tokenizer", documents(200))}


def _prepare(corpus: dict[str, Path], out: str, *extra: str, cwd: Path) -> tuple[int, str, str]:
    proc = cli_here(
        cwd,
        "prepare",
        "data=text",
        f"data.files={corpus['corpus']}",
        f"data.tokenizer={corpus['tokenizer']}",
        f"out={out}",
        "block_size=2KiB",
        *extra,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _corpus(tmp_path_factory.mktemp("store-corpus"))


@pytest.mark.unit
def test_parts_build_shards_a_killed_build_resumes_and_the_manifest_comes_last(corpus, tmp_path: Path, monkeypatch):
    """Part 0 of 2 builds shards 0 and 2 and writes no manifest; a build of part 1 killed inside its shard leaves it
    unbuilt (files, no record, no manifest); the call again builds only that shard and writes the manifest. Every
    document of every file is in one split of its shard, once, in order, its EOS after it."""
    from transformers import AutoTokenizer

    import launcher.prepare.store as build

    out = tmp_path / "store"
    code, stdout, _ = _prepare(corpus, str(out), "data.shard_index=0", "data.num_shards=2", cwd=tmp_path)
    assert code == 0 and "part 0 of 2: built 2 of its 2 shard(s)" in stdout, stdout
    assert "1 of 3 shards are not built yet (e.g. shard 00001, part 1)" in stdout, stdout
    assert not (out / "manifest.json").exists()

    real = build._put

    def killed(local, where):  # the val files of shard 1 are never written: the process is gone
        if where.name == "00001.val.tokens":
            raise KeyboardInterrupt
        real(local, where)

    monkeypatch.setattr(build, "_put", killed)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, str(out), "data.shard_index=1", "data.num_shards=2", cwd=tmp_path)
    assert (out / "shards" / "00001.train.tokens").exists() and not (out / "shards" / "00001.json").exists()
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(build, "_put", real)
    code, stdout, _ = _prepare(corpus, str(out), cwd=tmp_path)
    assert code == 0 and "built 1 of its 3 shard(s) (2 found built)" in stdout, stdout
    assert "the store is complete: 3 shards" in stdout, stdout
    code, stdout, _ = _prepare(corpus, str(out), cwd=tmp_path)
    assert "is complete already (3 shards)" in stdout

    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    manifest = json.loads((out / "manifest.json").read_text())
    eos = manifest["eos_id"]
    for i, shard in enumerate(manifest["shards"]):
        seen = []
        for split in ("train", "val"):
            tokens = np.fromfile(out / "shards" / f"{shard['name']}.{split}.tokens", dtype=manifest["dtype"])
            ends = np.fromfile(out / "shards" / f"{shard['name']}.{split}.docs", dtype="<i8")
            starts = np.concatenate([[0], ends[:-1]])
            assert all(tokens[e - 1] == eos for e in ends)
            seen += [tok.decode(tokens[b : e - 1].tolist()) for b, e in zip(starts, ends)]
        assert sorted(seen) == sorted(documents(60, seed=10 + i)), i


@pytest.fixture(scope="module")
def store(corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("store")
    code, _, stderr = _prepare(corpus, str(tmp / "store"), cwd=tmp)
    assert code == 0, stderr
    return tmp / "store"


def _store(url: str, tmp: Path, **given) -> Store:
    keys = {
        "url": url,
        "seq_len": 32,
        "packing": True,
        "format": "tuple",
        "vocab_size": None,
        "tokenizer": None,
        "cache_dir": str(tmp / "cache"),
        "cache_limit": "64KiB",
        "shuffle_blocks": 4,
    }
    return Store("train", **(keys | given))


@pytest.mark.unit
def test_samples_are_the_shards_tokens_packed_or_padded_and_the_order_is_a_permutation(store: Path, tmp_path) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    tokens = np.fromfile(store / "shards" / "00000.train.tokens", dtype=manifest["dtype"]).astype(np.int64)
    packed = _store(str(store), tmp_path)
    x, y = packed[3]
    assert x.tolist() == tokens[96:128].tolist() and y.tolist() == tokens[97:129].tolist()
    padded = _store(str(store), tmp_path, packing=False)
    ends = np.fromfile(store / "shards" / "00000.train.docs", dtype="<i8")
    x, y = padded[0]
    n = int(min(ends[0], 33))
    assert x[: min(n, 32)].tolist() == tokens[: min(n, 32)].tolist() and (y[n - 1 :] == -100).all()
    assert y[: n - 1].tolist() == tokens[1:n].tolist()
    for data in (packed, padded):
        order = data.epoch_order(5, 0)
        assert sorted(order.tolist()) == list(range(len(data)))
        assert np.array_equal(order, data.epoch_order(5, 0)) and not np.array_equal(order, data.epoch_order(5, 1))


@pytest.mark.unit
def test_a_flipped_byte_or_a_truncated_shard_is_refused_naming_it(store: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    file = copy / "shards" / "00001.train.tokens"
    data = bytearray(file.read_bytes())
    data[2048 + 5] ^= 0xFF  # block 1
    file.write_bytes(bytes(data))
    damaged = _store(str(copy), tmp_path)
    first = int(damaged.starts[1])  # shard 1's first window: block 0, intact
    damaged[first]
    with pytest.raises(StoreError, match=r"shard 00001's train tokens \(00001.train.tokens\), block 1 fails its check"):
        damaged[first + 2048 // 64]
    file.write_bytes(bytes(data[:3000]))
    with pytest.raises(StoreError, match=r"block 1 is truncated: 2,048 bytes recorded, 952 read"):
        _store(str(copy), tmp_path)[first + 2048 // 64]


@pytest.mark.unit
@pytest.mark.parametrize(
    "case,overrides,expected",
    [
        (
            "no manifest",
            ["data.url={tmp}"],
            "holds no manifest.json: not a token store, or one whose build has not finished",
        ),
        (
            "another tokenizer",
            ["data.url={store}", "data.tokenizer={other}"],
            "was built with another tokenizer than data.tokenizer=",
        ),
        (
            "a cache limit that is no size",
            ["data.url={store}", "data.cache_limit=lots"],
            "data.cache_limit=lots is not a size",
        ),
    ],
)
def test_a_store_that_cannot_be_read_is_one_line_before_start(case, overrides, expected, store, tmp_path) -> None:
    other = train_tokenizer(tmp_path / "other", documents(50, seed=3))
    given = [o.format(tmp=tmp_path, store=store, other=other) for o in overrides]
    line = launch_here(tmp_path, *TINY, "data=store", "data.seq_len=32", *given).refused()
    assert expected in line, line


@pytest.mark.long  # ~30 s: the store's order, resume and S3 reads are each tested at a smaller size in this file
def test_a_corpus_five_times_the_cache_trains_from_s3_and_resumes_at_another_world_size(corpus, tmp_path: Path) -> None:
    """Built from a bucket of jsonl into a bucket (moto's S3) by two parts run at once (as a SLURM array's tasks
    would), the store is 5x the cache limit. A run on 2 ranks (K=2) reads it through the cache, which never holds
    more than the limit (watched as the run goes), saves at step 4 and goes on to the end of an epoch; resumed from
    step 4 on 1 rank (K=4), steps 5 to the end log the same losses. A URL with a credential in it, a bucket that is
    not there and a cache too small for two blocks are one line each, the credential never shown."""
    import subprocess

    from conftest import LAUNCH

    with s3_server() as s3:
        url = s3.url("tokens")
        env = clean_env(tmp_path) | s3.env
        for file in sorted(corpus["corpus"].iterdir()):  # a bucket of jsonl, read where it is
            s3.fs().put_file(str(file), f"{s3.url('jsonl')}/{file.name}")
        parts = [
            subprocess.Popen(
                [
                    LAUNCH,
                    "prepare",
                    "data=text",
                    f"data.files={s3.url('jsonl')}/*.jsonl",
                    f"data.tokenizer={corpus['tokenizer']}",
                    f"out={url}",
                    "block_size=2KiB",
                    f"data.shard_index={i}",
                    "data.num_shards=2",
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=300) for p in parts]
        assert all(p.returncode == 0 for p in parts), outs
        assert s3.fs().exists(f"{url}/manifest.json"), outs
        manifest = json.loads(s3.fs().cat_file(f"{url}/manifest.json"))
        size = sum(s["splits"]["train"]["tokens"] * 2 for s in manifest["shards"])
        limit = size // 5
        cache = tmp_path / "cache"
        job = [
            *TINY,
            "data=store",
            f"data.url={url}",
            "data.seq_len=128",
            f"data.cache_dir={cache}",
            f"data.cache_limit={limit}",
            "data.shuffle_blocks=2",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=4",
            "trainer.keep_last=0",
            "trainer.warmup_steps=2",
        ]
        held, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                try:
                    held[0] = max(held[0], sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()))
                except FileNotFoundError:
                    pass
                done.wait(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        windows = sum((s["splits"]["train"]["tokens"] - 1) // 128 for s in manifest["shards"])
        steps = windows // 16  # one epoch
        first = launch(tmp_path, *job, f"trainer.max_steps={steps}", "gpus=2", name="two", env=env).check()
        done.set()
        watcher.join()
        assert 0 < held[0] <= limit, (held[0], limit)
        resume = f"resume={first.run_dir / 'checkpoints' / 'step_00000004'}"
        resumed = launch(tmp_path, *job, f"trainer.max_steps={steps}", "gpus=1", resume, name="one", env=env).check()
        assert [m["step"] for m in resumed.metrics] == list(range(5, steps + 1))
        a, b = {m["step"]: m["loss"] for m in first.metrics}, {m["step"]: m["loss"] for m in resumed.metrics}
        assert max(abs(a[s] - b[s]) for s in b) <= 1e-6
        secret = url.replace("s3://", f"s3://launch-test:{SECRET}@")
        line = launch_here(
            tmp_path, *TINY, "data=store", f"data.url={secret}", "data.seq_len=32", name="secret"
        ).refused()
        assert "carries credentials" in line and SECRET not in line, line
        line = launch_here(
            tmp_path, *TINY, "data=store", f"data.url={url}", "data.seq_len=32", "data.cache_limit=3KiB", name="small"
        ).refused()
        assert "data.cache_limit=3KiB holds fewer than two of the store's blocks of 2,048 bytes" in line, line
        line = launch_here(
            tmp_path, *TINY, "data=store", "data.url=s3://no-such-bucket/tokens", "data.seq_len=32", name="nobucket"
        ).refused()
        assert "s3://no-such-bucket does not exist (or these credentials cannot see it)" in line, line
