"""Evaluation: metrics of the user's choice (a torchmetrics Metric by `_target_`, a function returning sums and
counts) reduced over ranks exactly, and a model in nanoGPT's shape (built from a config object, `(logits, loss)`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import launch_once
from runs import PARITY_TOLERANCE, jobs, metrics, smoke

NANO = ["model=custom", "model._target_=eval_models.NanoClassifier", "+model.config._target_=eval_models.NanoConfig",
        "+model.config.channels=4", "+model.config.width=16", "data=custom", "data._target_=eval_models.images",
        "+data.channels=4"]  # fmt: skip
"""A classifier in nanoGPT's shape, on 64 training images and 13 validation images (an odd number)."""
METRICS = ["+trainer.metrics.accuracy._target_=torchmetrics.classification.MulticlassAccuracy",
           "+trainer.metrics.accuracy.num_classes=4", "+trainer.metrics.accuracy.average=micro",
           "+trainer.metrics.right._target_=eval_models.correct"]  # fmt: skip
JOB = ["batch.global_size=8", "batch.micro_size=2", "trainer.max_steps=4", "trainer.eval_every=2",
       "trainer.eval_batches=2", "optim.lr=0.1", "trainer.warmup_steps=1"]  # fmt: skip
"""16 validation samples per evaluation (the 13 and the first 3 again), 8 per rank at 2 ranks."""


def test_metrics_of_a_nanogpt_shaped_model_are_one_process_s_under_every_strategy(conformance_dir: Path) -> None:
    one = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, "gpus=1", name="eval-nano-one").check()
    run, sweep = smoke(conformance_dir, "eval-nano", *NANO, *METRICS, *JOB, "strategy=ddp,fsdp,zero2,zero3")
    assert run.returncode == 0, run.stderr[-3000:]
    # The tuple's loss, and each metric's inputs, found where only one thing can be meant: said once, at start.
    said = "its loss is its only scalar tensor, at position 1 (trainer.loss=1 says so)"
    assert one.stdout.count(said) == 1, one.stdout
    assert one.stdout.count("metric accuracy: preds = the model's output: position 0") == 1, one.stdout
    reference = one.metrics
    evaluated = [m for m in reference if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [2, 4]
    accuracy = [m["val/accuracy"] for m in evaluated]
    assert all(a * 16 == round(a * 16) for a in accuracy) and any(a * 8 != round(a * 8) for a in accuracy), accuracy
    assert accuracy == [m["val/right"] for m in evaluated]  # the Metric and the function of sums agree
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2", "zero3"]
    for strategy, job in jobs(sweep).items():
        logged = metrics(job)
        assert [m["loss"] for m in logged] == pytest.approx(
            [m["loss"] for m in reference], abs=PARITY_TOLERANCE[strategy]
        )
        theirs = [m for m in logged if "val_loss" in m]
        for name, tolerance in (("val/accuracy", 1e-7), ("val/right", 1e-7), ("val_loss", 1e-6)):
            assert [m[name] for m in theirs] == pytest.approx([m[name] for m in evaluated], abs=tolerance), (
                strategy,
                name,
            )


def test_each_validation_set_is_logged_under_its_name(conformance_dir: Path) -> None:
    """Two sets: one with the data's own validation images (its figures are the one-set run's), one of 5 images."""
    sets = ["+data.val.same={}", "+data.val.small.val_count=5"]
    two = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, *sets, name="eval-two-sets").check()
    one = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, name="eval-one-set").check()
    evaluated, reference = [m for m in two.metrics if "val/same/loss" in m], [m for m in one.metrics if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [m["step"] for m in reference] == [2, 4]
    for theirs, ours in zip(reference, evaluated):
        assert "val_loss" not in ours and "val/accuracy" not in ours, ours
        assert ours["val/same/loss"] == pytest.approx(theirs["val_loss"], abs=1e-12)
        assert ours["val/same/accuracy"] == pytest.approx(theirs["val/accuracy"], abs=1e-12)
        assert ours["val/small/loss"] != ours["val/same/loss"]
        assert {"val/small/accuracy", "val/small/right"} <= set(ours), ours
