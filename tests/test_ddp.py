"""DDP specifics and the runner end to end: one all-reduce per optimizer step, validation, multirun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, launch, launch_here

from launcher.models.gpt import GPT


def _n_params(**dims: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(**dims).parameters())


def test_accumulation_all_reduces_the_gradient_exactly_once(ddp_run: Run) -> None:
    """The conformance suite's DDP run on 2 ranks at K = 2: every step, one all-reduce of the whole fp32 gradient
    (without no_sync on the first micro-step it would be twice that)."""
    run = ddp_run
    n = _n_params(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    for m in run.metrics:
        assert m["accumulation"] == 2
        assert m["comm_bytes"] == 4 * n, (m["comm_bytes"], n)


def test_validation_loss_falls_on_python_source(ddp_run: Run) -> None:
    run = ddp_run  # padded Python source, evaluated at steps 6 and 12
    val = [m["val_loss"] for m in run.metrics if "val_loss" in m]
    assert len(val) == 2 and val[1] < val[0] - 0.15, val
    assert {"lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s", "peak_memory_bytes"} <= set(
        run.metrics[-1]
    )


def test_multirun_runs_each_job_as_its_own_distributed_run(tmp_path: Path) -> None:
    """Also DDP under precision=fp16: torch's loss scaler runs (its scale, 2^16 at the start, halved on an
    overflow, is logged) and the losses stay finite."""
    import json
    import math

    sweep = tmp_path / "sweep"
    run = launch(tmp_path, "-m", *TINY, "gpus=2", "precision=fp16", "trainer.max_steps=2,3", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 0, run.stderr
    jobs = [[json.loads(line) for line in (sweep / str(j) / "metrics.jsonl").read_text().splitlines()] for j in (0, 1)]
    assert sorted(len(m) for m in jobs) == [2, 3]
    for m in (step for job in jobs for step in job):
        assert math.isfinite(m["loss"]) and m["loss_scale"] in (2.0**16, 2.0**15, 2.0**14), m


@pytest.mark.unit
def test_a_model_that_cannot_be_built_is_refused_before_workers_start(tmp_path: Path) -> None:
    # model.n_head must divide n_embd: the launcher builds the model on the meta device once, before any worker.
    line = launch_here(tmp_path, *TINY, "gpus=2", "model.n_head=5").refused()
    assert (
        "model launcher.models.gpt.GPT could not be built: model.n_embd=64 is not divisible by model.n_head=5" in line
    )


def test_the_readme_user_path_end_to_end(tmp_path: Path) -> None:
    """One run through what README offers beyond the defaults: your own strategy preset from --config-dir, a token
    file, SGD, the linear schedule, bf16 under DDP, gradient clipping, wandb disabled, the static rendezvous."""
    import math

    import numpy as np
    from omegaconf import OmegaConf

    from launcher.parent.convert import weights

    (tmp_path / "my_conf" / "strategy").mkdir(parents=True)
    (tmp_path / "my_conf" / "strategy" / "mine.yaml").write_text("_target_: strategies.ddp.DDP\nbucket_cap_mb: 1\n")
    np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    lr, clip, steps = 0.05, 0.05, 4
    run = launch(
        tmp_path,
        "--config-dir",
        str(tmp_path / "my_conf"),
        "strategy=mine",
        *(o for o in TINY if not o.startswith(("data", "logger=", "trainer.warmup_steps"))),
        "data=tokens",
        f"data.path={tmp_path / 'tokens.bin'}",
        "data.seq_len=32",
        "optim=sgd",
        f"optim.lr={lr}",
        "optim.momentum=0",
        "trainer.schedule=linear",
        "trainer.warmup_steps=1",
        "trainer.min_lr_ratio=0",
        "precision=bf16",
        f"trainer.grad_clip={clip}",
        "logger=wandb",
        "logger.wandb.mode=disabled",
        "rdzv.backend=static",
        "gpus=2",
        "batch.global_size=8",
        f"trainer.max_steps={steps}",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=0",
    ).check()
    resolved = OmegaConf.load(run.run_dir / "resolved.yaml")
    assert resolved.strategy._target_ == "strategies.ddp.DDP" and resolved.strategy.bucket_cap_mb == 1  # the user's
    assert resolved.optim._target_ == "torch.optim.SGD" and resolved.rdzv.backend == "static"
    assert not list(run.run_dir.rglob("wandb*")), sorted(run.run_dir.rglob("*"))  # disabled: no wandb files
    # Linear decay after one warmup step: steps 2..4 at lr x (1 - (s - 2) / 2), down to 0 at the last.
    assert [m["lr"] for m in run.metrics] == pytest.approx([lr, lr, lr / 2, 0.0])
    # SGD without momentum or decay moves the weights by lr x the clipped gradient: |dw| = lr x min(norm, clip).
    with torch.device("meta"):  # the parameters once each (the embedding and the output layer are tied)
        names = [n for n, _ in GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32).named_parameters()]
    ckpt = run.run_dir / "checkpoints"
    before = weights(ckpt / "step_00000001")
    for m in run.metrics[1:]:
        after = weights(ckpt / f"step_{m['step']:08d}")
        moved = math.sqrt(sum(float((after[k] - before[k]).double().pow(2).sum()) for k in names))
        assert m["grad_norm"] > clip  # the clip bites (a fresh model's gradient is far larger)
        assert moved == pytest.approx(m["lr"] * clip, rel=1e-3, abs=1e-9), (moved, m)
        before = after
