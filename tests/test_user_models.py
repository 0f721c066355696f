"""Your model, your data: a transformers GPT-2 as it is (from a local folder, no download) under every strategy
through the smoke sweep users put in their CI, a classifier of images that is no language model, and the
one-line refusal of a model handed keys it does not take.

The smoke sweep's jobs are run once per session and shared by the tests that read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, Run, launch_here, launch_once, require_async_io, saved_gpt2
from runs import CLASSIFIER, PARITY_TOLERANCE, STRATEGIES, jobs, metrics, smoke

SEED = 1337
FIRST_STEP = 1e-6
"""Step 1's loss against one plain forward of the folder's model over the same batch: the same weights (no update
yet), the loss summed over micro-steps and ranks in another order of fp32 sums."""
GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 16}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="session")
def gpt2_folder(conformance_dir: Path) -> Path:
    """A tiny random GPT-2, saved with save_pretrained: what a user's local pretrained folder looks like."""
    return saved_gpt2(conformance_dir, "gpt2", GPT2 | NO_DROPOUT)


def hf(folder: Path) -> list[str]:
    """The overrides that train a transformers causal LM from a folder, with no wrapper: its batches in HF form."""
    return [
        "model=custom",
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"+model.pretrained_model_name_or_path={folder}",
        "data=pysource",
        "data.packing=false",
        "data.seq_len=16",
        "data.format=hf",
    ]


@pytest.fixture
def hf_sweep(conformance_dir: Path, gpt2_folder: Path) -> tuple[Run, Path]:
    return smoke(conformance_dir, "smoke-gpt2", *hf(gpt2_folder), "trainer.save_at_end=true")


def test_the_smoke_sweep_trains_a_transformers_model_as_it_is_under_every_strategy(hf_sweep) -> None:
    run, sweep = hf_sweep
    assert run.returncode == 0, run.stderr[-3000:]
    expected = set(STRATEGIES) - {"fsdp_tp"}  # a model may have no tensor-parallel plan: not swept over any model
    if "zero_infinity" in expected:
        require_async_io()
    assert set(jobs(sweep)) == expected, run.stdout
    table = run.stdout[run.stdout.index("job  ") :].splitlines()  # the outcome table the sweep ends with
    rows = {line.split()[2]: line.split()[3] for line in table[1 : 1 + len(expected)]}  # job: strategy=X, X, status
    assert rows == dict.fromkeys(expected, "ok"), table


def _next_token_loss(folder: Path, global_size: int) -> float:
    """The first global batch's loss, by hand: the folder's model, each real token predicting the next (padded
    positions are no targets), summed over the whole global batch and divided by its number of targets."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from launcher.config import schema
    from launcher.config.context import preset_dataset
    from launcher.data.builtin import GlobalBatches

    schema.register()
    data = preset_dataset("pysource", "train", seq_len=16, packing=False, format="hf")
    rows = [data[int(i)] for i in GlobalBatches(len(data), global_size, SEED).at(0)]
    ids, labels = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
    logits = AutoModelForCausalLM.from_pretrained(str(folder))(input_ids=ids).logits
    targets = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets, ignore_index=-100).item()


def test_labels_are_shifted_once_and_every_strategy_starts_from_the_folders_weights(hf_sweep, gpt2_folder) -> None:
    """Step 1's loss depends only on the starting weights and the batch: under every strategy it is the next-token
    loss of the folder's model (labels shifted twice would be the loss of the token after next)."""
    _, sweep = hf_sweep
    expected = _next_token_loss(gpt2_folder, global_size=4)
    for strategy, job in jobs(sweep).items():
        assert metrics(job)[0]["loss"] == pytest.approx(expected, abs=FIRST_STEP), strategy


def test_every_strategy_matches_one_process_on_a_transformers_model(hf_sweep, conformance_dir, gpt2_folder) -> None:
    _, sweep = hf_sweep
    one = launch_once(
        conformance_dir, "+sweep=smoke", *hf(gpt2_folder), "strategy=ddp", "gpus=1", name="smoke-gpt2-one-process"
    ).check()
    for strategy, job in jobs(sweep).items():
        losses = [m["loss"] for m in metrics(job)]
        assert losses == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), (strategy, losses, one.losses())
        assert "tokens_per_s" in metrics(job)[-1]


def test_fsdp_shards_a_transformers_model_by_its_own_blocks(hf_sweep) -> None:
    _, sweep = hf_sweep
    fsdp = metrics(jobs(sweep)["fsdp"])[-1]
    assert fsdp["comm_calls"] == GPT2["n_layer"] + 1  # one reduce-scatter per GPT2Block (_no_split_modules), one root


def test_convert_writes_a_folder_that_from_pretrained_loads(hf_sweep, gpt2_folder, tmp_path: Path) -> None:
    import subprocess

    from transformers import AutoModelForCausalLM

    from launcher.checkpoint.format import find_checkpoint
    from launcher.parent.convert import weights

    _, sweep = hf_sweep
    checkpoint = find_checkpoint(jobs(sweep)["zero3"])
    out = tmp_path / "exported"
    proc = subprocess.run(
        [LAUNCH, "convert", str(checkpoint), f"out={out}", *hf(gpt2_folder)[:3]], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    saved = weights(checkpoint)
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.long  # ~20 s: a model of one's own under every strategy is the smoke sweep's
def test_a_classifier_of_images_trains_under_ddp_fsdp_and_zero3(conformance_dir: Path) -> None:
    run, sweep = smoke(conformance_dir, "smoke-classifier", *CLASSIFIER, "strategy=ddp,fsdp,zero3")
    assert run.returncode == 0, run.stderr[-3000:]
    # One process, with a logger of the user's own: it gets every figure metrics.jsonl gets, between init and finish.
    logger = [
        "logger=custom",
        "logger.custom._target_=user_models.RecordingLogger",
        "+logger.custom.file=recorded.jsonl",
    ]
    one = launch_once(conformance_dir, "+sweep=smoke", *CLASSIFIER, "gpus=1", *logger, name="smoke-classifier-one")
    calls = [json.loads(line) for line in (one.check().run_dir / "recorded.jsonl").read_text().splitlines()]
    assert calls[0] == {"call": "init", "model": "user_models.Classifier"} and calls[-1] == {"call": "finish"}
    written = [{k: v for k, v in m.items() if k not in ("step", "time")} for m in one.metrics]
    assert [c["step"] for c in calls[1:-1]] == [m["step"] for m in one.metrics] == [1, 2], calls
    assert [c["metrics"] for c in calls[1:-1]] == written
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero3"]
    for strategy, job in jobs(sweep).items():
        logged = metrics(job)
        assert [m["loss"] for m in logged] == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), strategy
        assert "samples_per_s" in logged[-1] and "tokens_per_s" not in logged[-1], logged[-1]  # pixels are no tokens
    assert "the whole model is one unit" in run.stdout  # FSDP: no _no_split_modules, no shard_units: said so


@pytest.mark.unit
def test_a_model_handed_keys_it_does_not_take_is_refused(tmp_path: Path) -> None:
    line = launch_here(tmp_path, "model._target_=user_models.Classifier", "logger=none").refused()
    assert "model._target_=user_models.Classifier does not take model.block_size" in line, line
    assert "use model=custom model._target_=user_models.Classifier" in line, line
