"""Any data a user has: collates of their choice, Hugging Face datasets as they are, iterable and streamed datasets,
under the batch contract (the samples of step s depend on the seed and the global batch alone).

Unit tests read the sources in this process; the integration tests train real third-party parts built from configs
(torch_geometric's GCN with its Collater, a transformers classifier with DataCollatorWithPadding, a streamed
`datasets` corpus, a user's IterableDataset that ends) on 1 and 2 gloo ranks. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import launch, launch_here
from data_sources import Tokens, graphs, write_rows
from text_corpus import documents, train_tokenizer

from launcher.checkpoint.format import Position
from launcher.data.collate import DataError, default_collate
from launcher.data.sources import RandomAccess, Reading, Stream, resumes_by_state, source_of


def _steps(source, position: Position, steps: int, world: int, accumulation: int) -> list[list[list[torch.Tensor]]]:
    """Every rank's micro-batches of each step, rank by rank: [step][rank] -> its K micro-batches."""
    fed = [list(source.feed(position, steps, Reading(r, world, accumulation))) for r in range(world)]
    return [[fed[r][s].micro for r in range(world)] for s in range(len(fed[0]))]


def _inputs(step_ranks: list[list]) -> torch.Tensor:
    """The inputs a step trained on, over its ranks and micro-batches in order."""
    return torch.cat([m[0] if isinstance(m, (list, tuple)) else m["input_ids"] for rank in step_ranks for m in rank])


@pytest.mark.unit
@pytest.mark.parametrize("world,accumulation", [(1, 4), (2, 2), (4, 1)])
def test_a_stream_gives_every_step_its_samples_whatever_g_and_k(world: int, accumulation: int) -> None:
    """Step s trains on the stream's samples [sB, (s+1)B) in order, on any world size and accumulation; the stream
    that ends after 5.5 global batches gives 5 steps."""
    stream = Tokens(88)  # 5 global batches of 16 and 8 samples more
    expected = torch.stack([x for x, _ in stream])
    steps = _steps(source_of(stream, 16, 0, default_collate), Position(0, 0), 12, world, accumulation)
    assert len(steps) == 5
    for s, ranks in enumerate(steps):
        assert torch.equal(_inputs(ranks), expected[16 * s : 16 * (s + 1)]), s


def _jsonl_stream(tmp_path: Path, shuffled: bool = False):
    import datasets

    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n")
    stream = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
    return stream.shuffle(seed=0, buffer_size=32) if shuffled else stream


@pytest.mark.unit
def test_a_streamed_dataset_resumes_from_its_state_at_another_world_size(tmp_path: Path, capsys) -> None:
    """A datasets stream records its state with each step; a resume from step 3's state on 1 rank reads what the
    uninterrupted run on 2 ranks reads from step 4 on, without reading past the samples before it."""
    stream = _jsonl_stream(tmp_path)
    assert resumes_by_state(stream) == (True, "")
    source = Stream(stream, 16, default_collate)
    fed = list(source.feed(Position(0, 0), 8, Reading(0, 2, 2)))
    whole = [_inputs(s) for s in _steps(source, Position(0, 0), 8, 2, 2)]
    at_3 = Position(3, 48, fed[2].state)
    json.dumps(at_3.stream)  # plain data, as a checkpoint's manifest records it
    resumed = [_inputs(s) for s in _steps(Stream(_jsonl_stream(tmp_path), 16, default_collate), at_3, 5, 1, 4)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[3:], strict=True))
    assert "reading past" not in capsys.readouterr().out


@pytest.mark.unit
def test_a_stream_without_state_resumes_by_reading_past_its_samples_and_says_so(capsys) -> None:
    source = Stream(Tokens(200), 16, default_collate)
    whole = [_inputs(s) for s in _steps(source, Position(0, 0), 8, 2, 2)]
    resumed = [_inputs(s) for s in _steps(source, Position(3, 48), 5, 1, 4)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[3:], strict=True))
    out = capsys.readouterr().out
    assert "launch: data: the stream resumed at sample 48 by reading past the 48 before it" in out, out
    assert "it keeps no state_dict; every resume reads them again" in out, out


@pytest.mark.unit
def test_a_stream_asked_for_two_loader_processes_is_read_by_one_and_says_so(capsys) -> None:
    """data.workers=2 on a stream: one process reads it ahead of the loop (a stream has one order), the same samples
    as in the loop, and rank 0 says so in one line."""
    source = Stream(Tokens(64), 16, default_collate, "the train split")
    ahead = [_inputs([s.micro]) for s in source.feed(Position(0, 0), 3, Reading(0, 1, 1, workers=2))]
    assert (
        "launch: data: data.workers=2: the train split is a stream, read in its one order by one process ahead of "
        "the loop, not 2" in capsys.readouterr().out
    )
    here = [_inputs(s) for s in _steps(source, Position(0, 0), 3, 1, 1)]
    assert all(torch.equal(a, b) for a, b in zip(ahead, here, strict=True))


@pytest.mark.unit
def test_streams_a_run_cannot_read_in_one_order_are_named(tmp_path: Path) -> None:
    """A shuffle buffer is not in a datasets stream's state: it resumes by count; a generator cannot be read twice;
    a stream split by node would read another stream on each rank."""
    from datasets.distributed import split_dataset_by_node

    assert resumes_by_state(_jsonl_stream(tmp_path, shuffled=True)) == (
        False,
        "its shuffle buffer is not in its state_dict",
    )
    with pytest.raises(TypeError, match="a one-shot iterator"):
        Stream((x for x in range(3)), 16, default_collate)
    with pytest.raises(TypeError, match="split by node"):
        Stream(split_dataset_by_node(_jsonl_stream(tmp_path), rank=0, world_size=2), 16, default_collate)


@pytest.mark.unit
def test_the_default_collate_makes_tensors_of_lists_and_names_what_it_cannot_batch() -> None:
    """datasets rows of Python lists become [B, L] tensors (torch's default_collate alone would make L tensors of B
    first positions); ragged lists and strings are one line naming the field."""
    rows = [{"input_ids": [i, i + 1, i + 2], "label": i % 2} for i in range(4)]
    batch = default_collate(rows)
    assert batch["input_ids"].shape == (4, 3) and batch["input_ids"][1].tolist() == [1, 2, 3]
    assert batch["label"].tolist() == [0, 1, 0, 1]
    x, y = default_collate([(torch.arange(3), 1), (torch.arange(3), 0)])  # a tuple is fields, as torch's
    assert x.shape == (2, 3) and y.tolist() == [1, 0]
    with pytest.raises(DataError, match=r"field 'input_ids' of one micro-batch have lengths 2 to 3: .* pad them"):
        default_collate([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3]}])
    with pytest.raises(DataError, match=r"field 'text' is a str \('hello'\), neither a number"):
        default_collate([{"input_ids": [1], "text": "hello"}])


@pytest.mark.unit
def test_a_map_style_dataset_of_graphs_goes_through_the_collate_it_is_given() -> None:
    """PyG's Collater batches a rank's own graphs of each micro-batch; the same graphs at G=2 K=2 as at G=1 K=4."""
    from torch_geometric.loader.dataloader import Collater

    data = graphs("train")
    source = RandomAccess(data, 16, 3, Collater(None))
    two, one = _steps(source, Position(0, 0), 3, 2, 2), _steps(source, Position(0, 0), 3, 1, 4)
    for a, b in zip(two, one, strict=True):
        flat_a, flat_b = [m for rank in a for m in rank], [m for rank in b for m in rank]
        assert [m.num_graphs for m in flat_a] == [4] * 4
        assert all(torch.equal(p.x, q.x) and torch.equal(p.y, q.y) for p, q in zip(flat_a, flat_b, strict=True))


# ---------------------------------------------------------------- refusals, before any worker starts

TINY_DATA = [
    "model=gpt_tiny",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.block_size=16",
    "logger=none",
    "trainer.eval_every=0",
    "device=cpu",
    "batch.global_size=16",
    "batch.micro_size=4",
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "case,overrides,expected",
    [
        (
            "collate that does not import",
            ["data=synthetic", "data.seq_len=16", "data.collate._target_=no_such.collate"],
            "data.collate._target_=no_such.collate cannot be imported",
        ),
        (
            "collate that does not build",
            ["data=synthetic", "data.seq_len=16", "data.collate._target_=torch_geometric.loader.dataloader.Collater"],
            "data.collate._target_=torch_geometric.loader.dataloader.Collater does not build: ",
        ),
        (
            "collate with no tensors",
            ["data=synthetic", "data.seq_len=16", "data.collate._target_=data_sources.no_tensors"],
            "data: data.collate._target_=data_sources.no_tensors returned a list of 4 for the first micro-batch of the "
            "train split, with no tensor in it",
        ),
        (
            "empty stream",
            ["data=custom", "data._target_=data_sources.token_stream", "+data.count=0"],
            "data: the train split is a stream that yields no sample (batch.global_size=16); give it samples",
        ),
        (
            "short stream",
            ["data=custom", "data._target_=data_sources.token_stream", "+data.count=9"],
            "data: the train split is a stream that yields 9 sample(s), fewer than one global batch",
        ),
        ("one-shot stream", ["data=custom", "data._target_=data_sources.one_shot"], "is a one-shot iterator"),
        (
            "string field",
            ["data=custom", "data._target_=data_sources.strings"],
            "field 'text' is a str ('hello'), neither a number, a list of numbers nor a tensor",
        ),
    ],
)
def test_bad_data_is_one_line_before_any_worker(case: str, overrides: list, expected: str, tmp_path: Path) -> None:
    line = launch_here(tmp_path, *TINY_DATA, *overrides).refused()
    assert expected in line, line


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """jsonl rows of varying length with labels (train and test files), and a tokenizer whose pad token is its EOS."""
    root = tmp_path_factory.mktemp("rows")
    return {
        "train": write_rows(root / "rows" / "train.jsonl", 96),
        "test": write_rows(root / "rows" / "test.jsonl", 32, seed=1),
        "tokenizer": train_tokenizer(root / "tokenizer", documents(200), pad=True),
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    "case,overrides,expected",
    [
        ("split", ["data.split=nope"], "data.split=nope is not a split of data.path=json: it has train, test"),
        (
            "val split",
            ["data.val_split=validation"],
            "data.val_split=validation is not a split of data.path=json: it has train, test",
        ),
        (
            "text field",
            ["data.text_field=body"],
            "data.text_field: the rows of data.path=json (split train) have no field 'body'; they have text, label",
        ),
        ("no tokenizer, text left in", ["data.tokenizer=null"], "field 'text' is a str"),
        ("ragged, no collate", ["data.collate._target_=null"], "field 'input_ids' of one micro-batch have lengths"),
    ],
)
def test_bad_hf_data_is_one_line_naming_what_there_is(case, overrides, expected, rows, tmp_path: Path) -> None:
    files = f"data.data_files={{train:{rows['train']},test:{rows['test']}}}"
    line = launch_here(
        tmp_path,
        *TINY_DATA,
        "data=hf",
        "data.path=json",
        files,
        f"data.tokenizer={rows['tokenizer']}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *overrides,
    ).refused()
    assert expected in line, line


# ---------------------------------------------------------------- real runs: G=2, K=2 against one process, K=4

RUN = [
    "logger=none",
    "device=cpu",
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.warmup_steps=2",
    "batch.global_size=16",
    "batch.micro_size=4",
    "optim.lr=3e-3",
]
TOLERANCE = 1e-6


def _same_losses(a: list[dict], b: list[dict], steps: range) -> None:
    la, lb = {m["step"]: m["loss"] for m in a}, {m["step"]: m["loss"] for m in b}
    assert all(s in la and s in lb for s in steps), (sorted(la), sorted(lb), steps)
    worst = max(abs(la[s] - lb[s]) for s in steps)
    assert worst <= TOLERANCE, (worst, [(s, la[s], lb[s]) for s in steps])


def test_a_gcn_graph_classifier_with_pyg_collater_matches_one_process(tmp_path: Path) -> None:
    """torch_geometric's graphs (which default_collate cannot stack), batched per micro-batch by PyG's Collater: on
    2 ranks with K=2 under ddp, fsdp and zero2, every step's loss is one process's with K=4."""
    from runs import jobs, metrics

    pyg = [
        "model=custom",
        "model._target_=data_sources.GraphClassifier",
        "data=custom",
        "data._target_=data_sources.graphs",
        "data.collate._target_=torch_geometric.loader.dataloader.Collater",
        "+data.collate.dataset=null",
        "trainer.max_steps=6",
        "trainer.eval_every=3",
        "trainer.eval_batches=1",
        "trainer.save_at_end=false",
        *RUN,
    ]
    sweep = launch(tmp_path, "-m", *pyg, "strategy=ddp,fsdp,zero2", "gpus=2", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    one = launch(tmp_path, *pyg, "gpus=1", name="one").check()
    assert sweep.returncode == 0, sweep.stderr
    found = jobs(tmp_path / "sweep")
    assert sorted(found) == ["ddp", "fsdp", "zero2"], found
    for strategy, job in found.items():
        _same_losses(metrics(job), one.metrics, range(1, 7))
        vals = [(m["step"], m["val_loss"]) for m in metrics(job) if "val_loss" in m]
        assert [s for s, _ in vals] == [3, 6], (strategy, vals)


@pytest.mark.long  # ~17 s: a collate of one's own class is the PyG
# Collater's test; padded rows are the conformance suite's data
def test_a_transformers_classifier_on_text_of_any_length_with_data_collator_with_padding(rows, tmp_path: Path) -> None:
    """data=hf over jsonl rows of 2 to 40 words, tokenized once into a cache, padded per micro-batch by transformers'
    DataCollatorWithPadding, into a BERT classifier built from a config: 2 ranks with K=2 log one process's losses
    with K=4, and the second job found the tokenized rows in the cache."""
    from runs import metrics, sweep_parts

    tok = rows["tokenizer"]
    bert = [
        "model=custom",
        "model._target_=transformers.AutoModelForSequenceClassification.from_config",
        "+model.config._target_=transformers.BertConfig",
        "+model.config.vocab_size=320",
        "+model.config.hidden_size=32",
        "+model.config.num_hidden_layers=2",
        "+model.config.num_attention_heads=2",
        "+model.config.intermediate_size=64",
        "+model.config.max_position_embeddings=64",
        "+model.config.hidden_dropout_prob=0",
        "+model.config.attention_probs_dropout_prob=0",
    ]
    hf = [
        "data=hf",
        "data.path=json",
        f"data.data_files={{train:{rows['train']},test:{rows['test']}}}",
        "data.val_split=test",
        f"data.tokenizer={tok}",
        "data.max_length=48",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.collate._target_=transformers.DataCollatorWithPadding",
        "+data.collate.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
        f"+data.collate.tokenizer.pretrained_model_name_or_path={tok}",
    ]
    run = launch(
        tmp_path,
        "-m",
        *bert,
        *hf,
        *RUN,
        "trainer.max_steps=6",
        "trainer.eval_every=6",
        "trainer.eval_batches=1",
        "gpus=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert run.returncode == 0, run.stderr
    # Tokenized once (by the sweep's check of its jobs, before the first starts); each job found the rows cached.
    (cached,) = (tmp_path / "cache").iterdir()
    assert json.loads((cached / "manifest.json").read_text())["rows"] == {"train": 96, "val": 32}
    checks, ran = sweep_parts(run.stdout)
    assert "launch: data: tokenized 96 train and 32 validation rows" in checks, run.stdout
    assert "launch: data: tokenized" not in ran and ran.count("launch: data: found the tokenized rows") == 2, run.stdout
    one, two = (metrics(tmp_path / "sweep" / str(n)) for n in (0, 1))
    assert [m["world_size"] for m in two] == [2] * 6 and [m["accumulation"] for m in one] == [4] * 6
    _same_losses(two, one, range(1, 7))
    assert abs(one[-1]["val_loss"] - two[-1]["val_loss"]) <= TOLERANCE


def test_a_streamed_datasets_corpus_resumes_at_world_size_1_after_a_stop_at_2(rows, tmp_path: Path) -> None:
    """data=hf data.streaming=true over local jsonl (a datasets IterableDataset, tokenized as it is read), a GPT-2
    from a config padded per micro-batch by DataCollatorForLanguageModeling: a run on 2 ranks saves at step 3 with
    the stream's state; resumed from it on 1 rank (K=4), steps 4 to 6 log the 2-rank run's losses, the stream
    loaded from its state rather than read again."""

    tok = rows["tokenizer"]
    gpt2 = [
        "model=custom",
        "model._target_=transformers.AutoModelForCausalLM.from_config",
        "+model.config._target_=transformers.GPT2Config",
        "+model.config.vocab_size=320",
        "+model.config.n_layer=1",
        "+model.config.n_embd=32",
        "+model.config.n_head=2",
        "+model.config.n_positions=64",
        "+model.config.resid_pdrop=0",
        "+model.config.embd_pdrop=0",
        "+model.config.attn_pdrop=0",
    ]
    stream = [
        "data=hf",
        "data.path=json",
        f"data.data_files={rows['train']}",
        "data.streaming=true",
        f"data.tokenizer={tok}",
        "data.max_length=48",
        "data.collate._target_=transformers.DataCollatorForLanguageModeling",
        "+data.collate.mlm=false",
        "+data.collate.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
        f"+data.collate.tokenizer.pretrained_model_name_or_path={tok}",
        "trainer.eval_every=0",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=3",
        *RUN,
    ]
    first = launch(tmp_path, *gpt2, *stream, "gpus=2", name="two").check()
    manifest = json.loads((first.run_dir / "checkpoints" / "step_00000003" / "manifest.json").read_text())
    assert manifest["samples"] == 48 and isinstance(manifest["stream"], dict), manifest
    resumed = launch(
        tmp_path, *gpt2, *stream, "gpus=1", f"resume={first.run_dir / 'checkpoints' / 'step_00000003'}", name="one"
    ).check()
    assert "reading past" not in resumed.stdout and "resuming from" in resumed.stdout, resumed.stdout
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    _same_losses(resumed.metrics, first.metrics, range(4, 7))


def test_a_user_stream_that_ends_early_ends_the_run_on_every_rank_and_resumes_by_count(tmp_path: Path) -> None:
    """A user's IterableDataset of 7.5 global batches, with no state_dict, read by one process ahead of the loop:
    the run ends after step 7 on every rank (exit 0), saying so, with step 7's checkpoint. Resumed from step 4 on 1
    rank, the stream is read past its first 64 samples (said in one line), and steps 5 to 7 log the same losses."""

    job = [
        "model=gpt_tiny",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.block_size=16",
        "data=custom",
        "data._target_=data_sources.token_stream",
        "+data.count=120",
        "trainer.eval_every=0",
        "trainer.max_steps=12",
        "trainer.checkpoint_every=4",
        *RUN,
    ]
    first = launch(tmp_path, *job, "+data.workers=1", "gpus=2", name="two").check()
    assert [m["step"] for m in first.metrics] == list(range(1, 8)), first.metrics
    ended = "launch: data: the stream ended after 112 samples: step 7 trained its last full global batch of 16"
    assert ended in first.stdout, first.stdout
    assert (first.run_dir / "checkpoints" / "step_00000007" / "manifest.json").is_file()
    resumed = launch(
        tmp_path, *job, "gpus=1", f"resume={first.run_dir / 'checkpoints' / 'step_00000004'}", name="one"
    ).check()
    assert "launch: data: the stream resumed at sample 64 by reading past the 64 before it" in resumed.stdout
    assert [m["step"] for m in resumed.metrics] == [5, 6, 7]
    _same_losses(resumed.metrics, first.metrics, range(5, 8))


@pytest.mark.unit
def test_a_snapshot_of_the_local_hub_cache_is_read_as_it_is(tmp_path: Path) -> None:
    """data=hf over a dataset as the Hub cache keeps it (`datasets--ORG--NAME/snapshots/REVISION/data/*.parquet`),
    nothing downloaded: its rows, a validation part of them drawn by the seed, the same every time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.data.hf import HF

    snapshot = tmp_path / "hub" / "datasets--acme--tiny" / "snapshots" / ("0" * 40)
    (snapshot / "data").mkdir(parents=True)
    pq.write_table(
        pa.table({"input_ids": [[i, i + 1] for i in range(40)], "label": [i % 2 for i in range(40)]}),
        snapshot / "data" / "train-00000-of-00001.parquet",
    )
    keys = {
        "path": str(snapshot),
        "name": None,
        "split": "train",
        "val_split": None,
        "val_fraction": 0.1,
        "split_seed": 0,
        "data_files": None,
        "streaming": False,
        "tokenizer": None,
        "text_field": "text",
        "max_length": None,
        "columns": None,
        "cache_dir": str(tmp_path / "cache"),
    }
    train, val = HF("train", **keys), HF("val", **keys)
    assert len(train) == 36 and len(val) == 4
    assert sorted([r["input_ids"][0] for r in train] + [r["input_ids"][0] for r in val]) == list(range(40))
    assert [r["input_ids"] for r in HF("val", **keys)] == [r["input_ids"] for r in val]
