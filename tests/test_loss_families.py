"""The loss contract for every model family: a masked LM and a seq2seq model log the loss of one plain forward over
the whole global batch, and their gradients on 2 ranks under DDP, FSDP and ZeRO-3 are those of one process — on
samples that hold different numbers of targets. How a model counts its labels is decided once, in the launcher.

The causal LM's launches are tests/test_user_models.py's (a transformers GPT-2 on padded data under every
strategy); here it is checked that the launcher's rule for it is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import Run, launch_once
from omegaconf import OmegaConf
from runs import NORM_TOLERANCE, PARITY_TOLERANCE
from torch.utils.data import default_collate

from launcher.models.loss import LabelRule, StepTargets, count_targets, micro_loss, target_tokens

SEED = 1337  # the config's seed: the order of the samples
PLAIN, PLAIN_NORM = 1e-6, 1e-5
"""A logged loss and gradient norm against one plain forward and backward of the same weights over the same samples,
relatively: the launcher sums the loss over micro-steps and ranks, and the norm's squares over every parameter, in
other orders of fp32 sums (the strategies' own tolerances, `Conformance`, for the same reason)."""
GLOBAL = 8
COMMON = [
    "device=cpu",
    "logger=none",
    "data=custom",
    f"batch.global_size={GLOBAL}",
    "batch.micro_size=2",
    "trainer.log_every=1",
    "trainer.eval_batches=1",
    "trainer.warmup_steps=1",
    "trainer.progress=false",
    "trainer.save_at_end=false",
]
MASKED_LM = [
    "model=custom",
    "model._target_=loss_models.masked_lm",
    "data._target_=loss_models.masked_text",
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    *COMMON,
]
# lr 0: the weights stay the initial ones, so every step's loss and gradient, and the validation loss, are those of
# one plain forward that the test can make.
SEQ2SEQ = [
    "model=custom",
    "model._target_=loss_models.seq2seq",
    "data._target_=loss_models.reversal",
    "optim.lr=0",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    *COMMON,
]


def _runs(base: Path, name: str, overrides: list[str], strategies: str) -> dict[str, Run]:
    """One process (K=4), and 2 ranks (K=2) under each of `strategies`, in one multirun: strategy -> run."""
    one = launch_once(base, *overrides, "strategy=ddp", "gpus=1", name=f"{name}-one").check()
    sweep = base / f"{name}-sweep"
    many = launch_once(
        base, "-m", *overrides, f"strategy={strategies}", "gpus=2", f"hydra.sweep.dir={sweep}", name=f"{name}-two"
    ).check()
    jobs = {}
    for job in sorted(p for p in sweep.iterdir() if p.is_dir()):
        strategy = yaml.safe_load((job / "resolved.yaml").read_text())["job"]["choices"]["strategy"]
        jobs[strategy] = Run(many.returncode, many.stdout, many.stderr, job)
    assert sorted(jobs) == sorted(strategies.split(",")), many.stdout
    return {"one": one, **jobs}


@pytest.fixture
def masked_lm_runs(conformance_dir: Path) -> dict[str, Run]:
    return _runs(conformance_dir, "loss-masked-lm", MASKED_LM, "ddp,zero3")


@pytest.fixture
def seq2seq_runs(conformance_dir: Path) -> dict[str, Run]:
    return _runs(conformance_dir, "loss-seq2seq", SEQ2SEQ, "ddp,fsdp,zero3")


def plain(factory: str, data: str, indices: Any, split: str = "train") -> tuple[float, float]:
    """The loss of one plain forward over these samples of the data, and the norm of its gradient."""
    import loss_models

    dataset = getattr(loss_models, data)(split)
    model = getattr(loss_models, factory)()
    loss = model(**default_collate([dataset[int(i) % len(dataset)] for i in indices])).loss
    loss.backward()
    return loss.item(), torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    ).item()


def step_samples(data: str, step: int = 1) -> np.ndarray:
    """The samples of optimizer step `step` (1-based): they depend on the seed and the global size alone."""
    import loss_models

    from launcher.data.builtin import GlobalBatches

    return GlobalBatches(len(getattr(loss_models, data)("train")), GLOBAL, SEED).at((step - 1) * GLOBAL)


@pytest.mark.long  # ~25 s: the loss contract's arithmetic is tested in process below; the seq2seq
# family runs here
def test_a_masked_lm_logs_the_loss_of_one_forward_and_its_gradient_under_ddp_and_zero3(masked_lm_runs) -> None:
    loss, grad_norm = plain("masked_lm", "masked_text", step_samples("masked_text"))
    one = masked_lm_runs["one"]
    for name, run in masked_lm_runs.items():
        first = run.metrics[0]
        assert first["loss"] == pytest.approx(loss, rel=PLAIN), name  # was K times too large
        assert first["grad_norm"] == pytest.approx(grad_norm, rel=PLAIN_NORM), name
        # G=2 ranks x K=2 micro-steps train as one process with K=4: the same losses, gradients and validation loss.
        strategy = "ddp" if name == "one" else name
        assert run.losses() == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), name
        grads = [m["grad_norm"] for m in run.metrics]
        assert grads == pytest.approx([m["grad_norm"] for m in one.metrics], rel=NORM_TOLERANCE[strategy]), name
        val = run.metrics[-1]["val_loss"]
        assert val == pytest.approx(one.metrics[-1]["val_loss"], abs=PARITY_TOLERANCE[strategy]), name
    resolved = yaml.safe_load((one.run_dir / "resolved.yaml").read_text())
    assert resolved["derived"]["model"]["takes_num_items"] is False  # BERT ignores num_items_in_batch: not handed
    assert resolved["derived"]["model"]["label_shift"] == 0  # a masked LM's label is the target where it stands
    assert "usual recipe" not in one.stdout + masked_lm_runs["ddp"].stdout


def test_a_seq2seq_model_logs_the_loss_of_one_forward_its_gradient_and_its_validation_loss(seq2seq_runs) -> None:
    """At lr 0 every step's loss and gradient, and the validation loss, are those of one plain forward."""
    val, _ = plain("seq2seq", "reversal", np.arange(GLOBAL), split="val")  # evaluate's first global batch
    for name, run in seq2seq_runs.items():
        for step, logged in enumerate(run.metrics, start=1):
            loss, grad_norm = plain("seq2seq", "reversal", step_samples("reversal", step))
            assert logged["loss"] == pytest.approx(loss, rel=PLAIN), (name, step)
            assert logged["grad_norm"] == pytest.approx(grad_norm, rel=PLAIN_NORM), (name, step)
        assert run.metrics[-1]["val_loss"] == pytest.approx(val, rel=PLAIN), name
    one = seq2seq_runs["one"]
    for name, run in seq2seq_runs.items():  # G=2 x K=2 under ddp, fsdp and zero3: one process's gradients, K=4
        grads = [m["grad_norm"] for m in run.metrics]
        norm = NORM_TOLERANCE["ddp" if name == "one" else name]
        assert grads == pytest.approx([m["grad_norm"] for m in one.metrics], rel=norm), name


def test_a_model_whose_mean_stays_a_mean_is_named_once(conformance_dir: Path) -> None:
    """A classifier's (image, label) batch: the labels can be counted, but the launcher does not know its mean is
    over them, so the usual recipe scales it, and rank 0 says so once (K=4 micro-steps, 2 steps)."""
    from runs import CLASSIFIER

    # test_user_models' run, shared with it
    one = launch_once(
        conformance_dir,
        "+sweep=smoke",
        *CLASSIFIER,
        "gpus=1",
        "logger=custom",
        "logger.custom._target_=user_models.RecordingLogger",
        "+logger.custom.file=recorded.jsonl",
        name="smoke-classifier-one",
    ).check()
    lines = [line for line in one.stdout.splitlines() if "usual recipe" in line]
    assert len(lines) == 1, one.stdout
    assert lines[0].startswith("launch: loss: the model returns a mean and the launcher does not know"), lines


# What the launcher decides in the parent, on the meta device, and the arithmetic the workers do with it.


def _rule(target: str, **keys: Any) -> LabelRule:
    from launcher.models.meta import build_on_meta, measure

    size = measure(build_on_meta(OmegaConf.create({"_target_": target, **keys})))
    return LabelRule.of(size.as_dict())


@pytest.mark.unit
def test_how_a_model_counts_its_labels_is_decided_from_the_model() -> None:
    assert _rule("loss_models.masked_lm") == LabelRule(takes_num_items=False, label_shift=0)
    assert _rule("loss_models.seq2seq") == LabelRule(takes_num_items=False, label_shift=0)
    gpt2 = {"_target_": "transformers.GPT2Config", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}
    assert _rule("transformers.AutoModelForCausalLM.from_config", config=gpt2) == LabelRule(True, 1)
    llama = {
        "_target_": "transformers.LlamaConfig",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    assert _rule("transformers.AutoModelForCausalLM.from_config", config=llama) == LabelRule(True, 1)
    bert = {
        "_target_": "transformers.BertConfig",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    # A label per sample, over a loss the launcher cannot measure: not known, so its mean stays a mean.
    assert _rule("transformers.BertForSequenceClassification", config=bert) == LabelRule()
    assert _rule("user_models.Classifier") == LabelRule()  # a model of one's own counts as it likes


@pytest.mark.unit
def test_labels_are_counted_as_the_model_counts_them() -> None:
    labels = torch.tensor([[5, 6, -100, 7], [-100, 8, 9, -100]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    assert target_tokens(batch, label_shift=1) == (4, True)  # a causal LM: the first label of a row is no target
    assert target_tokens(batch, label_shift=0) == (5, True)  # masked LM, seq2seq: every label that is not -100
    assert target_tokens(batch, label_shift=None) == (5, False)  # unknown: counted as they stand, the mean kept
    assert target_tokens({"input_ids": labels, "targets": labels}, label_shift=0) == (5, False)
    assert target_tokens((labels, labels), label_shift=1) == (5, False)
    assert target_tokens({"input_ids": labels}, label_shift=1) == (None, False)


@pytest.mark.unit
def test_means_over_uneven_micro_batches_add_up_to_the_global_mean() -> None:
    """One rank, K=3 micro-batches of 1, 4 and 0 targets: the backward values add up to Σ sums / N, the logged parts
    to Σ sums, where the usual recipe (Σ means / K) would weigh a 1-target micro-batch as much as a 4-target one,
    and fail on the empty one."""
    rows = [torch.tensor([[3, -100, -100]]), torch.tensor([[1, 2, -100], [4, -100, 6]]), torch.tensor([[-100] * 3])]
    batches = [{"input_ids": r.clamp(min=0), "labels": r} for r in rows]
    token_losses = [torch.tensor([0.5]), torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([])]
    targets = count_targets(batches, 1, lambda v: v, label_shift=0)
    assert targets == StepTargets([1, 4, 0], [True] * 3, 5.0, 1)
    backward, logged = 0.0, 0.0
    for k, losses in enumerate(token_losses[:2]):
        value, part, normalised = micro_loss(losses.mean(), k, targets, accumulation=3)
        backward, logged = backward + value.item(), logged + part.item()
        assert normalised
    assert backward == pytest.approx(10.5 / 5) and logged == pytest.approx(10.5)
    with pytest.raises(ValueError, match="holds no targets"):  # a mean over none is 0/0: handing it a count is the fix
        micro_loss(torch.tensor(float("nan")), 2, targets, accumulation=3)
    value, part, _ = micro_loss(torch.tensor(0.0), 2, targets, accumulation=3, divided=True)  # num_items: 0, not NaN
    assert value.item() == 0.0 and part.item() == 0.0
    # Two ranks: each scales by G / N, and the strategies' average over ranks divides by G again.
    two = count_targets(batches[:2], 2, lambda v: [2 * x for x in v], label_shift=0)
    value, part, _ = micro_loss(torch.tensor(2.5), 1, two, accumulation=2)
    assert two.total == 10.0 and value.item() == pytest.approx(4 * 2.5 * 2 / 10) and part.item() == 10.0
