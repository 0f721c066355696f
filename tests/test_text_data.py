"""data=text: your files and your tokenizer, tokenized once in the launcher into a cache the workers map.

Each test makes its own corpus and tokenizer (tests/text_corpus.py: seeded random documents as jsonl and parquet, a
byte-level BPE trained on them with `tokenizers`, saved as a folder AutoTokenizer loads); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, launch, launch_here
from text_corpus import EOS, documents, make_corpus, text_settings, write_jsonl, write_parquet

SETTINGS = {"text_field": "text", "val_fraction": 0.1, "split_seed": 0}


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, Path]:
    return make_corpus(tmp_path / "made")


def _prepare(corpus: dict[str, Path], cache: Path, **settings) -> Path:
    from launcher.data.text import prepare

    keys = {"files": [str(corpus["corpus"])], "tokenizer": str(corpus["tokenizer"]), "cache_dir": str(cache)}
    return prepare(**text_settings(**keys, **(SETTINGS | settings)))


def _documents(folder: Path, split: str, tok) -> list[str]:
    """The documents of a split of a cache folder, decoded; each must end with the EOS token."""
    manifest = json.loads((folder / "manifest.json").read_text())
    tokens = np.fromfile(folder / f"{split}.bin", dtype=manifest["dtype"])
    docs = []
    for begin, end in np.load(folder / f"{split}.spans.npy"):
        ids = tokens[begin:end].tolist()
        assert ids[-1] == tok.convert_tokens_to_ids(EOS) and EOS not in tok.decode(ids[:-1]), ids
        docs.append(tok.decode(ids[:-1]))
    return docs


@pytest.mark.unit
def test_every_document_is_in_one_split_once_with_its_eos(corpus: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The cache holds every document of the jsonl and parquet files once, as the tokenizer gives it, EOS after it;
    the validation split is round(0.1 x 240) whole documents, the same for the same seed and others for another."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    folder = _prepare(corpus, tmp_path / "cache")
    assert "launch: data: tokenized 216 train and 24 validation documents" in capsys.readouterr().out
    train, val = _documents(folder, "train", tok), _documents(folder, "val", tok)
    assert sorted(train + val) == sorted(documents(240)) and len(val) == 24
    again = _prepare(corpus, tmp_path / "other-cache")
    assert _documents(again, "val", tok) == val
    reseeded = _prepare(corpus, tmp_path / "cache", split_seed=1)
    assert reseeded != folder and set(_documents(reseeded, "val", tok)) != set(val)
    separate = _prepare(corpus, tmp_path / "cache", val_files=[str(corpus["val"])])
    assert sorted(_documents(separate, "train", tok)) == sorted(documents(240))
    assert _documents(separate, "val", tok) == documents(24, seed=1)


@pytest.mark.unit
def test_a_second_launch_finds_the_cache_and_a_changed_file_builds_a_new_one(
    corpus: dict[str, Path], tmp_path: Path, capsys
) -> None:
    folder = _prepare(corpus, tmp_path / "cache")
    assert "tokenized" in capsys.readouterr().out
    written = (folder / "manifest.json").stat().st_mtime_ns
    assert _prepare(corpus, tmp_path / "cache") == folder
    assert "found the tokens of 216 train and 24 validation documents (" in capsys.readouterr().out
    assert (folder / "manifest.json").stat().st_mtime_ns == written
    write_jsonl(corpus["jsonl"], documents(130))  # the same name, other documents
    changed = _prepare(corpus, tmp_path / "cache")
    assert changed != folder and "tokenized 225 train and 25 validation documents" in capsys.readouterr().out
    changed_tokenizer = _prepare(corpus, tmp_path / "cache", eos_token="a")  # another setting: another cache
    assert changed_tokenizer not in (folder, changed)
    with open(changed / "train.bin", "r+b") as f:  # a cache damaged since: truncated
        f.truncate(100)
    assert _prepare(corpus, tmp_path / "cache") == changed
    assert "was damaged" in capsys.readouterr().out and (changed / "train.bin").stat().st_size > 100


@pytest.mark.unit
def test_an_interrupted_build_leaves_nothing_complete_and_workers_never_tokenize(
    corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build stopped half way (here: Ctrl-C between writing its splits) leaves no folder a worker would map; nor
    does one killed outright (its temporary folder, whose process is gone, is removed by the next build). `Text`
    (what each worker calls) refuses to run without a complete cache rather than tokenizing."""
    from launcher.data import text_build
    from launcher.data.text import Text

    cache = tmp_path / "cache"
    real = text_build.write

    def interrupted(partial: Path, name: str, *rest):  # Ctrl-C once train.bin is written, before val.bin
        if name == "val":
            assert (partial / "train.bin").stat().st_size > 0
            raise KeyboardInterrupt
        return real(partial, name, *rest)

    monkeypatch.setattr(text_build, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, cache)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(text_build, "write", real)
    keys = {"files": [str(corpus["corpus"])], "tokenizer": str(corpus["tokenizer"]), "cache_dir": str(cache)}
    with pytest.raises(RuntimeError, match="no complete token cache"):
        Text("train", **text_settings(**keys, **SETTINGS))
    killed = cache / f".x.partial-{socket.gethostname()}-{2**22 + 12345}"  # a pid past the kernel's default limit
    (killed / "hf").mkdir(parents=True)
    folder = _prepare(corpus, cache)
    assert not killed.exists() and [p.name for p in cache.iterdir()] == [folder.name]
    assert len(Text("train", **text_settings(**keys, **SETTINGS, seq_len=16))) > 0


@pytest.mark.unit
def test_documents_without_text_are_left_out_and_counted_and_txt_files_are_read(
    corpus: dict[str, Path], tmp_path: Path, capsys
) -> None:
    from transformers import AutoTokenizer

    docs = documents(30)
    gaps = write_jsonl(tmp_path / "gaps" / "a.jsonl", [*docs[:10], "", "   ", *docs[10:]])
    with open(gaps, "a") as f:
        f.write(json.dumps({"id": 99, "text": None}) + "\n")
    (tmp_path / "gaps" / "b.txt").write_text("first paragraph\nof two lines\n\nsecond paragraph\n")
    made = {"corpus": tmp_path / "gaps", "tokenizer": corpus["tokenizer"]}
    folder = _prepare(made, tmp_path / "cache", val_fraction=0.0, txt_sample_by="paragraph")
    assert "32 train and 0 validation documents" in capsys.readouterr().out
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["skipped_documents"] == 3, manifest
    text = _documents(folder, "train", AutoTokenizer.from_pretrained(str(corpus["tokenizer"])))
    assert text[:30] == docs and [t.strip() for t in text[30:]] == ["first paragraph\nof two lines", "second paragraph"]


@pytest.mark.unit
def test_every_kind_of_file_is_read(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Compressed jsonl, parquet, an arrow file and a folder written by save_to_disk inside a folder (read whole by
    load_from_disk, not as its own files), named by a glob and a folder: their documents in the order of the files,
    each file's in its own order."""
    import gzip

    import pyarrow as pa
    from datasets import Dataset
    from transformers import AutoTokenizer

    docs = documents(40, seed=3)
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:  # the text under another name than the other files'
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:10])
    write_parquet(tmp_path / "in" / "b.parquet", docs[10:20], field="body")
    with pa.ipc.new_stream(str(tmp_path / "in" / "c.arrow"), pa.schema([("body", pa.string())])) as stream:
        stream.write_table(pa.table({"body": docs[20:30]}))
    Dataset.from_dict({"body": docs[30:], "n": list(range(10))}).save_to_disk(str(tmp_path / "in" / "d" / "saved"))
    (tmp_path / "in" / ".hidden.jsonl").write_text("not json\n")  # left out, as a folder's hidden files are
    from launcher.data.text import prepare

    keys = text_settings(
        files=[str(tmp_path / "*.jsonl.gz"), str(tmp_path / "in")],
        text_field="body",
        tokenizer=str(corpus["tokenizer"]),
        val_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="a.jsonl.gz has no field 'body' \\(its fields: text\\)"):
        prepare(**keys)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs[:10])
    folder = prepare(**keys)
    assert _documents(folder, "train", AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))) == docs


@pytest.mark.unit
@pytest.mark.parametrize("template", ["<s> $A", "$A </s>"])
def test_the_tokenizers_own_special_tokens_are_kept_and_eos_is_not_doubled(template: str, tmp_path: Path) -> None:
    """A tokenizer that adds BOS itself (Llama's) keeps it before each document, the EOS after; one that adds EOS
    itself gets no second one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tok = Tokenizer(models.WordLevel(words, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "tok")
    write_jsonl(tmp_path / "docs.jsonl", ["a b", "b b a"])
    made = {"corpus": tmp_path / "docs.jsonl", "tokenizer": tmp_path / "tok"}
    folder = _prepare(made, tmp_path / "cache", val_fraction=0.0)
    expected = [0, 2, 3, 1, 0, 3, 3, 2, 1] if template.startswith("<s>") else [2, 3, 1, 3, 3, 2, 1]
    assert np.fromfile(folder / "train.bin", dtype=np.uint16).tolist() == expected


@pytest.mark.unit
def test_packed_and_padded_samples(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Packed: consecutive windows of the token stream (documents and their EOS end to end). Padded: one sample per
    chunk of a document, labels -100 where padded (data.format=hf), as data=pysource data.packing=false."""
    from omegaconf import OmegaConf

    from launcher.data.text import Text

    folder = _prepare(corpus, tmp_path / "cache")
    files = OmegaConf.create([str(corpus["jsonl"]), str(corpus["corpus"] / "*.parquet")])  # as a worker gets them
    keys = {"files": files, "tokenizer": str(corpus["tokenizer"]), "cache_dir": str(tmp_path / "cache")}
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    packed = Text("train", **text_settings(**keys, **SETTINGS, seq_len=16))
    assert len(packed) == (len(tokens) - 1) // 16
    inputs, targets = packed[3]
    assert inputs.tolist() == tokens[48:64].tolist() and targets.tolist() == tokens[49:65].tolist()
    padded = Text("train", **text_settings(**keys, **SETTINGS, seq_len=16, packing=False, format="hf"))
    spans = np.load(folder / "train.spans.npy")
    assert len(padded) == sum(-(-(end - begin - 1) // 16) for begin, end in spans)
    first = padded[0]
    n = min(17, int(spans[0, 1] - spans[0, 0]))
    assert first["input_ids"][: min(n, 16)].tolist() == tokens[: min(n, 16)].tolist()
    assert (first["labels"][n:] == -100).all() and (first["labels"][:n] >= 0).all()


@pytest.mark.unit
def test_a_vocabulary_over_65536_ids_is_kept_in_uint32(tmp_path: Path) -> None:
    """uint16 would wrap ids above 65,535 silently: a tokenizer of 70,000 ids gives uint32 tokens, read back whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {EOS: 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(words, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(tmp_path / "tok"))
    texts = [" ".join(f"w{(d * 7919 + i * 104729) % 70_000}" for i in range(40)) for d in range(50)]
    write_jsonl(tmp_path / "big.jsonl", texts)
    made = {"corpus": tmp_path / "big.jsonl", "tokenizer": tmp_path / "tok"}
    folder = _prepare(made, tmp_path / "cache", val_fraction=0.0)
    assert json.loads((folder / "manifest.json").read_text())["dtype"] == "uint32"
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint32)
    expected = [i for text in texts for i in [*(int(w[1:]) + 1 for w in text.split()), 0]]  # EOS (0) after each
    assert tokens.tolist() == expected and tokens.max() > 65_535


# ----------------------------------------------------------------------------------------------- refused before start

NOT_DATA = [o for o in TINY if not o.startswith("data")]


def _text(corpus: dict[str, Path], tmp_path: Path, *extra: str) -> list[str]:
    return [
        *NOT_DATA,
        "data=text",
        f"data.files={corpus['corpus']}",
        f"data.tokenizer={corpus['tokenizer']}",
        "data.seq_len=16",
        f"data.cache_dir={tmp_path / 'cache'}",
        "batch.global_size=8",
        "batch.micro_size=4",
        *extra,
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    "case",
    [
        "no such field",
        "no such column",
        "matches nothing",
        "tokenizer too large for the model",
        "too small for a global batch",
        "tokenizer that does not load",
        "no tokenizer there",
        "no EOS token",
        "vocab_size below the tokenizer's",
    ],
)
def test_bad_text_input_is_one_line_before_any_worker(case: str, corpus: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')  # cut short
    bare = tmp_path / "bare.json"  # a tokenizer.json alone: no tokenizer_config.json to name its EOS token
    shutil.copy(corpus["tokenizer"] / "tokenizer.json", bare)
    overrides, expected = {
        "no such field": (
            ["data.text_field=body"],
            f"{corpus['jsonl']} has no field 'body' (its fields: id, text); "
            "name the one that holds the text with data.text_field=...",
        ),
        "no such column": (
            [f"data.files={corpus['parquet']}", "data.text_field=body"],
            f"{corpus['parquet']} has no field 'body' (its fields: id, text)",
        ),
        "matches nothing": ([f"data.files={tmp_path}/nowhere/*.jsonl"], "/nowhere/*.jsonl matches no file"),
        "tokenizer too large for the model": (["model.vocab_size=64"], "the model embeds 64 ids but data.tokenizer="),
        "too small for a global batch": (
            ["batch.global_size=4096", "batch.micro_size=4"],
            "fewer than one global batch (batch.global_size=4096)",
        ),
        "tokenizer that does not load": (
            [f"data.tokenizer={broken}"],
            f"data.tokenizer={broken} does not load as a tokenizer",
        ),
        "no tokenizer there": ([f"data.tokenizer={tmp_path}/none"], "does not exist; point it at a local tokenizer"),
        "no EOS token": ([f"data.tokenizer={bare}"], f"names no EOS token (its added tokens: {EOS}); name the token"),
        "vocab_size below the tokenizer's": (
            ["data.vocab_size=100"],
            "data.vocab_size=100 is smaller than the 320 ids of data.tokenizer=",
        ),
    }[case]
    run = launch_here(tmp_path, *_text(corpus, tmp_path, *overrides))
    line = run.refused()
    assert expected in line, line
    assert "Traceback" not in run.stdout + run.stderr and "interpolation" not in line
    if case == "tokenizer too large for the model":
        assert "model.vocab_size=${data.vocab_size}" in line and "gives 320 (data.vocab_size)" in line


@pytest.mark.unit
def test_a_corpus_with_no_text_names_its_files(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Documents that are all empty, blank or without the text field's value: one line naming the files and why, not
    a cache of 0 tokens that "cannot make one sample"."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text('{"id": 0, "text": ""}\n{"id": 1, "text": "   "}\n')
    (empty / "b.jsonl").write_text('{"id": 2, "text": null}\n{"id": 3}\n')
    line = launch_here(tmp_path, *_text(corpus, tmp_path, f"data.files={empty}/*.jsonl")).refused()
    assert line == (
        f"launch: error: data.files: every one of the 4 document(s) in {empty / 'a.jsonl'}, {empty / 'b.jsonl'} is "
        "empty, blank or has no 'text' value: no token to train on; point it at files with text, or name the field "
        "that holds it with data.text_field=..."
    ), line
    assert not any((tmp_path / "cache").rglob("*.bin"))  # no cache of nothing


@pytest.mark.unit
def test_a_tokenizer_not_given_is_named_not_the_model_key_that_follows_it(corpus: dict[str, Path], tmp_path) -> None:
    overrides = [o for o in _text(corpus, tmp_path) if not o.startswith("data.tokenizer")]
    line = launch_here(tmp_path, *overrides).refused()
    assert line == "launch: error: data.tokenizer has no value; set it on the command line: data.tokenizer=...", line


# ---------------------------------------------------------------------------------------------------- real launches

RUN = ["trainer.max_steps=6", "batch.global_size=16", "batch.micro_size=4", "optim.lr=3e-3"]


def test_tokenize_workers_give_the_same_tokens(corpus: dict[str, Path], tmp_path: Path) -> None:
    """datasets.map in 2 processes: the same cache, byte for byte, as in this one (its folder is the same key's)."""
    one = _prepare(corpus, tmp_path / "one")
    two = _prepare(corpus, tmp_path / "two", tokenize_workers=2)
    assert one.name == two.name
    for name in ("train.bin", "val.bin", "train.spans.npy", "val.spans.npy"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_two_ranks_match_one_process_and_resume_exactly_on_another_world_size(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """The batch contract on your text: G=2 K=2 logs the losses of one process with K=4 (fp32, to 1e-6), padded (each
    sample holds its own number of targets; packed samples, all full, train in the store and elastic tests); a resume
    on one process of the 2-rank run's step-3 checkpoint continues with its losses."""
    job = [*_text(corpus, tmp_path, "data.packing=false"), *RUN, "trainer.checkpoint_every=3", "trainer.keep_last=0"]
    two = launch(tmp_path, *job, "gpus=2", name="two").check()
    assert "launch: data: tokenized" in two.stdout
    one = launch(tmp_path, *job, "gpus=1", name="one").check()
    assert "launch: data: found the tokens" in one.stdout
    a, b = two.losses(), one.losses()
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-6, (a, b)
    resumed = launch(
        tmp_path, *job, "gpus=1", f"resume={two.run_dir / 'checkpoints' / 'step_00000003'}", name="resumed"
    ).check()
    steps = {m["step"]: m["loss"] for m in resumed.metrics}
    assert sorted(steps) == [4, 5, 6] and max(abs(steps[s] - a[s - 1]) for s in steps) <= 1e-6, (steps, a)


@pytest.mark.long  # ~15 s: the text store's parity is the two-rank test's; a transformers model on any data is
# test_data_sources'
def test_a_transformers_model_trains_on_it_as_it_is(corpus: dict[str, Path], tmp_path: Path) -> None:
    """GPT-2 from transformers, built from a config of the tokenizer's vocabulary, on padded documents in its own
    batch form (data.format=hf); its loss falls. Its workers are started afresh (as on CUDA, not forked) and read
    through a DataLoader process each: both find the launcher's cache by its key and map it."""
    gpt2 = [
        "model=custom",
        "model._target_=transformers.AutoModelForCausalLM.from_config",
        "+model.config._target_=transformers.GPT2Config",
        "+model.config.n_layer=2",
        "+model.config.n_embd=64",
        "+model.config.n_head=4",
        "+model.config.n_positions=16",
        "+model.config.vocab_size=${data.vocab_size}",
    ]
    job = [o for o in _text(corpus, tmp_path, "data.packing=false", "data.format=hf") if not o.startswith("model")]
    fresh = ["trainer.fork_workers=false", "data.workers=1"]
    run = launch(tmp_path, *job, *gpt2, *RUN, *fresh, "trainer.max_steps=12", "gpus=2").check()
    losses = run.losses()
    assert len(losses) == 12 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
    assert os.path.exists(run.run_dir / "resolved.yaml")
