"""EMA weights (trainer.ema): the same average at any world size and accumulation under DDP, FSDP and ZeRO-3, a
resume across strategies and world sizes that keeps it exact, its validation loss, `launch convert ema=true`, and
its bad values refused before start."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, cli_here, launch_here, launch_once
from runs import PARITY_TOLERANCE

EMA_JOB = [
    *(o for o in TINY if not o.startswith("trainer.eval_every")),
    "trainer.eval_every=3",
    "trainer.eval_batches=1",
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=3",
    "trainer.keep_last=0",
    "optim.lr=3e-3",
    "trainer.ema.decay=0.7",
]
"""Six steps, validated and saved at 3 and 6; a fast average (decay 0.7), far from the weights at that rate."""


@functools.cache
def _run(tmp: Path, strategy: str, gpus: int, *extra: str) -> Run:
    name = "ema-" + "-".join([strategy, str(gpus), *(e.replace("=", "_").replace("/", "_") for e in extra)])
    return launch_once(tmp, *EMA_JOB, f"strategy={strategy}", f"gpus={gpus}", *extra, name=name).check()


def _val(run: Run, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in run.metrics if key in m}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_the_average_of_two_ranks_at_k2_is_one_process_at_k4(strategy: str, conformance_dir: Path) -> None:
    """The EMA weights' validation loss at steps 3 and 6: 2 ranks x 2 micro-steps (each rank averaging what it holds:
    the whole model, its FSDP shard, its ZeRO-3 partition) equal one process x 4, within the strategy's declared
    tolerance; and the average is
    not the weights (its loss differs from val_loss)."""
    one, two = _run(conformance_dir, "ddp", 1), _run(conformance_dir, strategy, 2)
    assert sorted(_val(one, "val_ema_loss")) == [3, 6]
    assert _val(two, "val_ema_loss") == pytest.approx(_val(one, "val_ema_loss"), abs=PARITY_TOLERANCE[strategy])
    assert _val(two, "val_loss") == pytest.approx(_val(one, "val_loss"), abs=PARITY_TOLERANCE[strategy])
    assert all(abs(_val(one, "val_ema_loss")[s] - _val(one, "val_loss")[s]) > 1e-4 for s in (3, 6))


@pytest.mark.long  # 4 ranks, then one process resuming
def test_the_average_under_pp2_dp2_is_one_process_s_and_resumes_in_one_process(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """Pipeline parallel (2 stages x 2 data-parallel ranks, K = 2 micro-batches through 1F1B): each stage averages its
    own parameters, the tied embedding on both stages alike; the EMA weights' validation loss at steps 3 and 6 is one
    process's within the pipeline's declared tolerance; its step-3 checkpoint (the average under the whole model's
    names) resumed in one process under ddp gives the uninterrupted run's average at step 6."""
    from launcher.config import schema
    from launcher.config.context import preset_strategy

    schema.register()
    tolerance = preset_strategy("fsdp", pp_size=2).conformance().tolerance
    one, pp = _run(conformance_dir, "ddp", 1), _run(conformance_dir, "fsdp", 4, "strategy.pp_size=2")
    assert _val(pp, "val_ema_loss") == pytest.approx(_val(one, "val_ema_loss"), abs=tolerance)
    assert all(abs(_val(pp, "val_ema_loss")[s] - _val(pp, "val_loss")[s]) > 1e-4 for s in (3, 6))
    step3 = pp.run_dir / "checkpoints" / "step_00000003"
    resumed = launch_once(tmp_path, *EMA_JOB, "strategy=ddp", "gpus=1", f"resume={step3}", name="pp-resumed").check()
    assert _val(resumed, "val_ema_loss")[6] == pytest.approx(_val(pp, "val_ema_loss")[6], abs=tolerance)


def test_an_average_that_has_not_started_is_the_weights(conformance_dir: Path) -> None:
    """trainer.ema.start past the last step: the average is the weights themselves, its loss theirs exactly."""
    run = _run(conformance_dir, "ddp", 2, "trainer.ema.start=6")
    assert _val(run, "val_ema_loss") == _val(run, "val_loss")


def test_a_resume_from_fsdp_at_two_ranks_into_zero2_at_one_keeps_the_average(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """FSDP's sharded average (DTensors) saved at step 3, resumed by ZeRO-2 on one rank (DeepSpeed's neutral import):
    the average at step 6 is the uninterrupted run's, within FSDP's declared tolerance."""
    full = _run(conformance_dir, "fsdp", 2)
    step3 = full.run_dir / "checkpoints" / "step_00000003"
    resumed = launch_once(tmp_path, *EMA_JOB, "strategy=zero2", "gpus=1", f"resume={step3}", name="resumed").check()
    assert sorted(_val(resumed, "val_ema_loss")) == [6]
    assert _val(resumed, "val_ema_loss")[6] == pytest.approx(
        _val(full, "val_ema_loss")[6], abs=PARITY_TOLERANCE["fsdp"]
    )


@pytest.mark.long  # 15-30 s: launch eval ema=true reads the same average back
def test_convert_with_ema_writes_the_average(conformance_dir: Path, tmp_path: Path) -> None:
    """`launch convert CKPT ema=true`: the EMA weights (the checkpoint's `ema.weights.*`) for every trainable
    parameter, which differ from the model's; without ema=true, the model's own."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = _run(conformance_dir, "ddp", 1).run_dir / "checkpoints" / "step_00000006"
    dcp_to_torch_save(str(checkpoint), str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    for ema, expected in ((True, saved["ema"]["weights"]), (False, saved["model"])):
        out = tmp_path / f"ema-{ema}.safetensors"
        proc = cli_here(tmp_path, "convert", str(checkpoint), f"out={out}", f"ema={str(ema).lower()}")
        assert proc.returncode == 0, proc.stderr
        written = load_file(str(out))
        assert sorted(written) == sorted(saved["model"])
        assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert any(not torch.equal(saved["ema"]["weights"][k], saved["model"][k]) for k in saved["ema"]["weights"])


@pytest.mark.long  # 20-40 s: launch eval's own test (zero3) covers the evaluation path
def test_launch_eval_with_ema_gives_the_run_s_average_at_one_process(conformance_dir: Path) -> None:
    """`launch eval CKPT ema=true` of FSDP's checkpoint at 2 ranks, at one process under DDP: the EMA weights'
    validation loss is the one the run logged at that step, within 1e-6, and not the weights' own."""
    import json

    full = _run(conformance_dir, "fsdp", 2)
    checkpoint = full.run_dir / "checkpoints" / "step_00000006"
    proc = launch_once(
        conformance_dir,
        "eval",
        str(checkpoint),
        "ema=true",
        *EMA_JOB,
        "strategy=ddp",
        "gpus=1",
        name="eval-ema-of-fsdp",
    )
    proc.check()
    evaluated = json.loads((conformance_dir / "eval-ema-of-fsdp" / "eval.json").read_text())
    assert evaluated["step"] == 6 and sorted(evaluated["figures"]) == ["val_ema_loss"], evaluated
    assert evaluated["figures"]["val_ema_loss"] == pytest.approx(_val(full, "val_ema_loss")[6], abs=1e-6)
    assert abs(evaluated["figures"]["val_ema_loss"] - _val(full, "val_loss")[6]) > 1e-4


def test_launch_eval_with_ema_of_a_checkpoint_without_an_average_is_one_line(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint saved without trainer.ema: ema=true refused before any worker starts, naming the checkpoint;
    and ema=true of a checkpoint moved away from its run (no resolved.yaml beside it) without the run's
    trainer.ema.decay, too."""
    no_decay = [o for o in EMA_JOB if "ema" not in o]
    plain = launch_once(conformance_dir, *no_decay, "strategy=ddp", "gpus=1", "trainer.max_steps=3", name="ema-none")
    checkpoint = plain.check().run_dir / "checkpoints" / "step_00000003"
    line = launch_here(tmp_path, "eval", str(checkpoint), "ema=true", *EMA_JOB).refused()
    assert "holds no EMA weights" in line and str(checkpoint) in line, line
    import shutil

    averaged = tmp_path / "moved" / "step_00000003"
    shutil.copytree(_run(conformance_dir, "fsdp", 2).run_dir / "checkpoints" / "step_00000003", averaged)
    line = launch_here(tmp_path, "eval", str(averaged), "ema=true", *no_decay).refused()
    assert "trainer.ema.decay" in line, line


REFUSED = [
    ("trainer.ema.decay=1.5", "trainer.ema.decay=1.5"),
    ("trainer.ema.decay=0", "trainer.ema.decay=0"),
    ("trainer.ema.every=0", "trainer.ema.every=0"),
]


@pytest.mark.unit
@pytest.mark.parametrize("override,named", REFUSED)
def test_a_decay_outside_zero_to_one_is_one_line(override: str, named: str, tmp_path: Path) -> None:
    proc = cli_here(tmp_path, *TINY, override)
    assert proc.returncode != 0
    (error,) = [e for e in proc.stderr.splitlines() if e.strip()]
    assert named in error, error
