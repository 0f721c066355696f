"""The learning-rate schedule (`launcher.worker.optimizers.lr_at`): warmup, then cosine, linear or constant down to the
floor, as a function and as a run logs it."""

from __future__ import annotations

import math

import pytest
from conftest import Run

from launcher.worker.optimizers import lr_at


@pytest.mark.unit
def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    lrs = [lr_at(s, 1.0, warmup=10, max_steps=100, schedule="cosine", min_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lr_at(50, 1.0, 10, 100, "constant", 0.1) == 1.0
    assert lr_at(99, 1.0, 10, 100, "linear", 0.0) == pytest.approx(0.0)
    # Interior points, where cosine and linear part: a quarter of the way through the decay (steps 10..90 of 91),
    # cosine is at (1 + cos(pi/4)) / 2 = 0.85355 of the way down from 1 to the floor 0.1, linear at 0.75.
    assert lr_at(30, 1.0, 10, 91, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.853553, rel=1e-6)
    assert lr_at(30, 1.0, 10, 91, "linear", 0.1) == pytest.approx(0.1 + 0.9 * 0.75, rel=1e-9)
    assert lr_at(70, 1.0, 10, 91, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.146447, rel=1e-5)
    assert lr_at(4, 1.0, 10, 91, "cosine", 0.1) == pytest.approx(0.5)  # warmup: (step + 1) / warmup


def test_the_logged_lr_is_the_schedule(one_process: Run) -> None:
    """JOB's schedule, written out: optim.lr=3e-3, 4 warmup steps of (s / 4), then cosine over the 7 steps after
    them, from 1 down to the floor (trainer.min_lr_ratio=0.1) at step 12."""
    expected = {
        s: 3e-3 * (s / 4 if s <= 4 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 5) / 7))) for s in range(1, 13)
    }
    logged = {m["step"]: m["lr"] for m in one_process.metrics}
    assert logged == pytest.approx(expected, rel=1e-9), logged
