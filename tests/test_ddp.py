"""DDP specifics and the runner end to end: one all-reduce per optimizer step, validation, multirun."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import TINY, launch

from launcher.models.gpt import GPT


def _n_params(**dims: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(**dims).parameters())


def test_accumulation_all_reduces_the_gradient_exactly_once(tmp_path: Path) -> None:
    run = launch(tmp_path, *TINY, "gpus=2", "batch.global_size=32", "batch.micro_size=4", "trainer.max_steps=3").check()
    n = _n_params(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    for m in run.metrics:
        assert m["accumulation"] == 4
        # Four micro-steps, one all-reduce of the whole fp32 gradient: without no_sync it would be 4x.
        assert m["comm_bytes"] == 4 * n, (m["comm_bytes"], n)


def test_validation_loss_falls_on_python_source(tmp_path: Path) -> None:
    overrides = [
        *TINY,
        "data=pysource",
        "gpus=2",
        "batch.global_size=16",
        "trainer.max_steps=30",
        "trainer.eval_every=15",
        "optim.lr=3e-3",
    ]
    run = launch(tmp_path, *overrides).check()
    val = [m["val_loss"] for m in run.metrics if "val_loss" in m]
    assert len(val) == 2 and val[1] < val[0] - 0.15, val
    assert {"lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s", "peak_memory_bytes"} <= set(
        run.metrics[-1]
    )


def test_multirun_runs_each_job_as_its_own_distributed_run(tmp_path: Path) -> None:
    run = launch(tmp_path, "-m", *TINY, "gpus=2", "trainer.max_steps=2,3", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert run.returncode == 0, run.stderr
    steps = sorted(len((tmp_path / "sweep" / str(j) / "metrics.jsonl").read_text().splitlines()) for j in (0, 1))
    assert steps == [2, 3]


def test_a_model_that_cannot_be_built_is_refused_before_workers_start(tmp_path: Path) -> None:
    # model.n_head must divide n_embd: the launcher builds the model on the meta device once, before any worker.
    line = launch(tmp_path, *TINY, "gpus=2", "model.n_head=5").refused()
    assert (
        "model launcher.models.gpt.GPT could not be built: model.n_embd=64 is not divisible by model.n_head=5" in line
    )
