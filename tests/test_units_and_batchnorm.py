"""FSDP's units never split tied weights, and BatchNorm is synchronised on request.

The tie rule is read on models built on the meta device (no launch); two launches train a BERT masked LM, whose
word embedding is tied to its decoder, under FSDP from its own `_no_split_modules`; two more train a BatchNorm CNN
with `strategy.sync_batchnorm=true` under DDP and FSDP against one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import launch_here, launch_once
from runs import PARITY_TOLERANCE

from launcher.config import schema
from strategies.base import RunContext
from strategies.units import split_ties, tied_unit_lines, unit_classes

schema.register()  # the presets' schemas, for launcher.config.context.preset_strategy

BERT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 256,
    "max_position_embeddings": 32,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
CTX = RunContext(
    device="cpu", rank=0, local_rank=0, world_size=2, precision="fp32", grad_clip=1.0, accumulation=1, micro_size=1
)


def on_meta(build):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return build()


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return on_meta(lambda: BertForMaskedLM(BertConfig(**BERT)))


@pytest.mark.unit
def test_bert_leaves_its_tied_embeddings_to_the_root_and_keeps_its_layers() -> None:
    model = bert()
    lines = tied_unit_lines(model, None)
    assert sorted(model._no_split_modules) == ["BertEmbeddings", "BertLayer"]
    assert unit_classes(model, None) == ["BertLayer"]  # what FSDP's setup shards by: the same rule
    assert len(lines) == 1, lines
    assert lines[0].startswith("BertEmbeddings is not a unit, though BertForMaskedLM._no_split_modules lists it")
    assert (
        "bert.embeddings.word_embeddings.weight (in BertEmbeddings) = cls.predictions.decoder.weight (in the root)"
        in lines[0]
    )
    assert tied_unit_lines(model, ["BertLayer"]) == [] and unit_classes(model, ["BertLayer"]) == ["BertLayer"]


@pytest.mark.unit
def test_explicit_units_that_split_a_tie_are_refused_naming_the_tied_parameters_and_a_fix() -> None:
    with pytest.raises(ValueError) as e:
        tied_unit_lines(bert(), ["BertEmbeddings", "BertLayer"])
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("strategy.shard_units=[BertEmbeddings,BertLayer] splits tied parameters"), line
    assert "bert.embeddings.word_embeddings.weight" in line and "cls.predictions.decoder.weight" in line, line
    assert line.endswith("use strategy.shard_units=[BertLayer] (units that keep each tied parameter together)"), line


@pytest.mark.unit
@pytest.mark.parametrize("replicate_size", [1, None], ids=["fsdp", "hsdp"])
def test_fsdp_and_hsdp_check_the_same_rule_in_the_parent(replicate_size, capsys) -> None:  # type: ignore[no-untyped-def]
    from launcher.config.context import preset_strategy

    preset_strategy("fsdp", replicate_size=replicate_size).check(CTX, bert())
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "BertEmbeddings" in line] == [out[0]] and out[0].startswith("launch: fsdp: "), out
    with pytest.raises(ValueError, match=r"^strategy.shard_units=\[BertEmbeddings\] splits tied parameters"):
        preset_strategy("fsdp", shard_units=["BertEmbeddings"], replicate_size=replicate_size).check(CTX, bert())


@pytest.mark.unit
def test_tied_lms_whose_ties_stay_in_the_root_keep_their_blocks() -> None:
    """GPT-2, Llama and the built-in GPT tie the input embedding to the LM head, both in the root: every block stays
    a unit."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from launcher.models.gpt import GPT

    gpt2 = on_meta(lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)))
    llama = on_meta(
        lambda: LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                vocab_size=64,
                tie_word_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    )
    ours = on_meta(lambda: GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    for model, block in ((gpt2, "GPT2Block"), (llama, "LlamaDecoderLayer"), (ours, "Block")):
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        assert len(names) == len(list(model.parameters())) + 1  # one tied pair
        assert unit_classes(model, None) == [block] and tied_unit_lines(model, None) == [], type(model).__name__


@pytest.mark.unit
def test_ties_between_two_units_of_a_class_and_between_a_unit_and_the_root_drop_those_classes_only() -> None:
    from units_models import TiedAcrossBlocks

    model = on_meta(TiedAcrossBlocks)
    ties = split_ties(model, ["Block", "Embedding", "Plain"])
    assert sorted(t.names for t in ties) == [
        ("blocks.0.linear.weight", "blocks.1.linear.weight"),
        ("embed.table.weight", "head.weight"),
    ]
    classes, lines = unit_classes(model, None), tied_unit_lines(model, None)
    assert classes == ["Plain"]
    assert [line.split()[0] for line in lines] == ["Block", "Embedding"], lines
    assert "blocks.0.linear.weight (in Block) = blocks.1.linear.weight (in Block)" in lines[0]
    assert split_ties(model, classes) == []


@pytest.mark.unit
def test_deepspeed_refuses_sync_batchnorm_in_one_line() -> None:
    from units_models import BatchNormNet

    from launcher.config.context import preset_strategy

    with pytest.raises(ValueError, match=r"^strategy.sync_batchnorm=true is not supported by DeepSpeed") as e:
        preset_strategy("zero3", sync_batchnorm=True).check(CTX, on_meta(BatchNormNet))
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_all_reduce_batchnorm_is_plain_batchnorm_in_one_process_and_keeps_its_state_dict() -> None:
    from units_models import BatchNormNet

    from strategies.batchnorm import AllReduceBatchNorm, sync_batchnorm

    torch.manual_seed(0)
    plain = BatchNormNet()
    synced = sync_batchnorm(BatchNormNet(), "cpu")
    synced.load_state_dict(plain.state_dict())
    assert sorted(synced.state_dict()) == sorted(plain.state_dict())
    assert sum(isinstance(m, AllReduceBatchNorm) for m in synced.modules()) == 2
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    assert torch.equal(synced(x, y), plain(x, y))


# ---------------------------------------------------------------- launches

BERT_RUN = [
    "model=custom",
    "model._target_=transformers.BertForMaskedLM",
    "+model.config._target_=transformers.BertConfig",
    *(f"+model.config.{k}={v}" for k, v in BERT.items()),
    "data=synthetic",
    "data.seq_len=16",
    "data.format=hf",
    "trainer.max_steps=3",
]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long  # ~15 s: FSDP's units from a transformers model's own blocks are test_user_models'
def test_bert_trains_under_fsdp_from_its_own_units_as_one_process(conformance_dir: Path) -> None:
    """K=1 in both runs, so that the comparison rests on the units alone, not on how a masked LM's loss is counted
    over micro-steps."""
    run = launch_once(
        conformance_dir, "+sweep=smoke", *BERT_RUN, "strategy=fsdp", "batch.micro_size=2", name="units-bert-fsdp"
    ).check()
    one = launch_once(
        conformance_dir,
        "+sweep=smoke",
        *BERT_RUN,
        "strategy=ddp",
        "gpus=1",
        "batch.micro_size=4",
        name="units-bert-one",
    )
    assert "launch: fsdp: BertEmbeddings is not a unit, though" in run.stdout, run.stdout
    assert run.losses() == pytest.approx(one.check().losses(), abs=PARITY_TOLERANCE["fsdp"]), (
        run.losses(),
        one.losses(),
    )
    assert len(run.losses()) == 3
    assert run.metrics[-1]["comm_calls"] == BERT["num_hidden_layers"] + 1  # one reduce-scatter per BertLayer, the root


@pytest.mark.unit
def test_bert_with_explicit_units_that_split_its_tie_is_refused_before_start(tmp_path: Path) -> None:
    line = launch_here(
        tmp_path, "+sweep=smoke", *BERT_RUN, "strategy=fsdp", "strategy.shard_units=[BertEmbeddings,BertLayer]"
    ).refused()
    assert "launch: error: strategy.shard_units=[BertEmbeddings,BertLayer] splits tied parameters" in line, line
    assert "use strategy.shard_units=[BertLayer]" in line, line


MICRO = 4
STATISTICS = 1e-6
"""BatchNorm's running mean and variance after 4 steps against one process's, as the losses (`Conformance.tolerance`):
each step's from the statistics of the global batch, which synchronised BatchNorm sums over the ranks in another
order of fp32 sums, of activations of weights that moved by the losses' ulps (2.4e-7 measured under ddp and fsdp)."""
BATCHNORM = [
    "model=custom",
    "model._target_=units_models.BatchNormNet",
    "data=custom",
    "data._target_=units_models.images",
    "trainer.max_steps=4",
    "trainer.save_at_end=true",
    f"batch.global_size={2 * MICRO}",
]


def test_sync_batchnorm_on_2_ranks_is_one_process_with_both_micro_batches(conformance_dir: Path) -> None:
    """At K=1, synchronised BatchNorm over G=2 ranks of micro-batch m normalises each step's global batch of 2m
    samples as one process with micro-batch 2m does: the same losses (each strategy's declared tolerance), and the
    checkpoint's running statistics are that process's (`STATISTICS`), under DDP and FSDP. (At K > 1 no one-process
    run equals it: each of its micro-steps normalises the G micro-batches of that micro-step together.)"""
    from launcher.checkpoint.format import find_checkpoint
    from launcher.parent.convert import weights

    sweep = conformance_dir / "units-batchnorm"
    run = launch_once(
        conformance_dir,
        "-m",
        "+sweep=smoke",
        *BATCHNORM,
        f"batch.micro_size={MICRO}",
        "strategy=ddp,fsdp",
        "strategy.sync_batchnorm=true",
        f"hydra.sweep.dir={sweep}",
        name="units-batchnorm",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    one = launch_once(
        conformance_dir,
        "+sweep=smoke",
        *BATCHNORM,
        f"batch.micro_size={2 * MICRO}",
        "gpus=1",
        "strategy=ddp",
        name="units-batchnorm-one",
    ).check()
    expected = weights(find_checkpoint(one.run_dir))
    stats = sorted(k for k in expected if "running" in k or "num_batches" in k)
    assert len(stats) == 6 and int(expected["features.1.num_batches_tracked"]) == 4, stats
    jobs = {json.loads((d / "outcome.json").read_text())["strategy"]: d for d in sweep.iterdir() if d.is_dir()}
    assert sorted(jobs) == ["ddp", "fsdp"]
    for strategy, job in jobs.items():
        losses = [m["loss"] for m in metrics(job)]
        assert losses == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), (strategy, losses, one.losses())
        saved = weights(find_checkpoint(job))
        apart = max(float((saved[key].double() - expected[key].double()).abs().max()) for key in stats)
        print(f"{strategy}: running statistics at most {apart:.1e} from one process's")  # shown with pytest -s
        assert apart <= STATISTICS, (strategy, apart)
