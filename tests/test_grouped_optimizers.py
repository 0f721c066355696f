"""Several optimizers over one model's groups: a rule of optim.groups that names a `_target_` has its parameters
stepped by that optimizer (one per group's class, stepped together, one state dict), one process's updates under
DDP and FSDP, resumed exactly across strategies and world sizes."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from conftest import TINY, Run, launch_here, launch_once
from runs import PARITY_TOLERANCE

GROUPED_JOB = [
    *TINY,
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=3",
    "trainer.keep_last=0",
    "optim.lr=3e-3",
    "optim.groups=[{name: 'blocks.*', _target_: torch.optim.SGD, momentum: 0.9, lr_scale: 10}]",
]
"""SGD with momentum over the blocks (their norms and biases too, without decay), AdamW over the embeddings."""


@functools.cache
def _run(tmp: Path, strategy: str, gpus: int) -> Run:
    return launch_once(tmp, *GROUPED_JOB, f"strategy={strategy}", f"gpus={gpus}", name=f"grouped-{strategy}-{gpus}")


@pytest.mark.long  # 20-40 s: Muon+AdamW's parity tests run the same one-optimizer-per-group path
def test_two_optimizers_over_groups_at_two_ranks_equal_one_process(conformance_dir: Path) -> None:
    """FSDP at 2 ranks x 2 micro-steps equals one DDP process x 4 within FSDP's declared tolerance; the start line
    names each group's optimizer; the losses are not AdamW's alone (SGD steps the blocks)."""
    one, two = _run(conformance_dir, "ddp", 1).check(), _run(conformance_dir, "fsdp", 2).check()
    assert len(one.losses()) == 6
    assert max(abs(a - b) for a, b in zip(one.losses(), two.losses(), strict=True)) <= PARITY_TOLERANCE["fsdp"]
    assert "_target_ torch.optim.SGD" in one.stdout, one.stdout
    adamw = launch_once(conformance_dir, *GROUPED_JOB[:-1], "gpus=1", name="grouped-adamw-reference").check()
    assert max(abs(a - b) for a, b in zip(one.losses()[1:], adamw.losses()[1:])) > 1e-3


@pytest.mark.long  # 20-40 s: the Muon and EMA resumes cover the grouped state's checkpoint
def test_a_resume_from_fsdp_at_two_ranks_into_one_process_goes_on_exactly(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """SGD's momentum and AdamW's moments (FSDP's shards, one state dict), saved at step 3, resumed by one process."""
    full = _run(conformance_dir, "fsdp", 2).check()
    step3 = full.run_dir / "checkpoints" / "step_00000003"
    resumed = launch_once(tmp_path, *GROUPED_JOB, "gpus=1", f"resume={step3}", name="grouped-resumed").check()
    assert len(resumed.losses()) == 3
    assert max(abs(a - b) for a, b in zip(full.losses()[3:], resumed.losses(), strict=True)) <= PARITY_TOLERANCE["fsdp"]


@pytest.mark.unit
def test_a_group_optimizer_under_zero_is_one_line(tmp_path: Path) -> None:
    line = launch_here(tmp_path, *GROUPED_JOB, "strategy=zero2").refused()
    assert "optim.groups[0]._target_=torch.optim.SGD: ZeRO steps one optimizer" in line, line
