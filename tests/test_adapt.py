"""Runs that adapt without changing their result (`launcher.adapt`): batch.micro_size=auto, halved after an
out-of-memory error by a restart of the worker group, trains the trajectory of a run that used the smaller
micro-batch from the start."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, launch

ADAPTIVE = [
    *TINY,
    "model._target_=faulty.SmallMemoryGPT",
    "+model.fits=2",  # micro-batches of 8 and 4 run out of memory; 2 fits
    "+model.at_call=5",  # after a few steps, so that the restarted group resumes from a checkpoint
    "batch.global_size=16",
    "trainer.max_steps=8",
    "trainer.checkpoint_every=2",
    "trainer.collective_timeout=60",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The same run at micro-batch 2 from the start (the model never runs out of memory there)."""
    run = launch(tmp_path_factory.mktemp("reference"), *ADAPTIVE, "batch.micro_size=2")
    assert run.returncode == 0, run.stderr
    return {int(m["step"]): m["loss"] for m in run.metrics}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_an_out_of_memory_error_halves_the_micro_batch_and_keeps_the_trajectory(
    strategy: str, reference: dict[int, float], tmp_path: Path
) -> None:
    run = launch(tmp_path, *ADAPTIVE, f"strategy={strategy}", "batch.micro_size=auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "auto: batch.micro_size=8 (accumulation 1 at world size 2)" in run.stdout, run.stdout
    for before, after in ((8, 4), (4, 2)):  # each change said in a line, by the rank that ran out of memory
        said = "ran out of memory in forward/backward of step"
        assert any(said in line and f"at micro-batch {before}; the worker group restarts at micro-batch {after}" in line
                   for line in (run.stdout + "".join(p.read_text() for p in (run.run_dir / "logs").rglob("*.log"))
                                ).splitlines()), run.stdout  # fmt: skip
    metrics = run.metrics
    sizes = [(int(m["micro_size"]), int(m["accumulation"])) for m in metrics]
    assert sizes[0] == (8, 1) and sizes[-1] == (2, 4) and (4, 2) in sizes, sizes  # carried across later restarts
    assert [int(m["restart"]) for m in metrics][-1] == 2
    # Every logged step, the redone ones too, is the reference's step: the trajectory never changed.
    worst = max(abs(m["loss"] - reference[int(m["step"])]) for m in metrics)
    assert worst <= 1e-6, worst
    assert sorted({int(m["step"]) for m in metrics}) == sorted(reference)
