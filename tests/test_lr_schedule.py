"""The learning-rate schedule (`launcher.optim.schedules`): warmup, then cosine, linear, constant, warmup-stable-decay,
inverse square root or a function of the step of the user's own, down to the floor, as a function and as a run logs
it; phases that do not fit refused before start."""

from __future__ import annotations

import math

import pytest
from conftest import Run

from launcher.optim.schedules import lr_at


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


@pytest.mark.unit
def test_wsd_holds_the_rate_until_the_decay_and_reaches_the_floor_at_the_last_step() -> None:
    """100 steps, 10 of warmup, the last 20 decaying: warmup ends at optim.lr (step 9), the rate holds through step 79
    (the last stable one), the decay's first step is one twentieth of the way down, its last is the floor. Each shape
    at the decay's midpoint (progress 1/2): linear 1/2, 1 - sqrt(1/2), cosine 1/2 of the way from the floor to 1."""
    wsd = dict(base=2.0, warmup=10, max_steps=100, schedule="wsd", min_ratio=0.1, decay_steps=20)
    at = [lr_at(s, **wsd) for s in range(100)]  # type: ignore[arg-type]
    assert at[0] == pytest.approx(0.2) and at[9] == 2.0
    assert set(at[9:80]) == {2.0}
    assert at[80] == pytest.approx(2.0 * (0.1 + 0.9 * (1 - 1 / 20)))
    assert at[99] == pytest.approx(0.2) and all(a > b for a, b in zip(at[79:], at[80:]))
    for shape, fraction in (("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)):
        assert lr_at(89, **wsd, shape=shape) == pytest.approx(2.0 * (0.1 + 0.9 * fraction)), shape  # type: ignore[arg-type]
    # No stable phase at all: the decay starts right after warmup; no warmup: the first step is at optim.lr.
    assert lr_at(10, 1.0, 10, 30, "wsd", 0.0, decay_steps=20) == pytest.approx(1 - 1 / 20)
    assert lr_at(0, 1.0, 0, 30, "wsd", 0.0, decay_steps=20) == 1.0


@pytest.mark.unit
def test_wsd_decays_over_a_fraction_of_max_steps_and_inverse_sqrt_falls_as_one_over_root_step() -> None:
    from omegaconf import OmegaConf

    from launcher.optim.schedules import schedule_lr

    trainer = OmegaConf.create({"schedule": "wsd", "warmup_steps": 0, "min_lr_ratio": 0.0, "decay_fraction": 0.25})
    assert schedule_lr(trainer, 1.0, 74, 100) == 1.0 and schedule_lr(trainer, 1.0, 75, 100) == pytest.approx(0.96)
    assert lr_at(15, 1.0, 4, 100, "inverse_sqrt", 0.0) == pytest.approx(math.sqrt(4 / 16))
    assert lr_at(3, 1.0, 4, 100, "inverse_sqrt", 0.0) == 1.0  # the end of warmup meets it


@pytest.mark.unit
def test_a_function_of_the_users_own_is_the_schedule() -> None:
    from omegaconf import OmegaConf

    from launcher.optim.schedules import schedule_lr

    trainer = OmegaConf.create(
        {
            "schedule": "custom",
            "warmup_steps": 0,
            "min_lr_ratio": 0.0,
            "schedule_fn": {"_target_": "user_models.step_halving", "every": 3},
        }
    )
    assert [schedule_lr(trainer, 0.8, s, 12) for s in range(7)] == [0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.2]


REFUSED = [
    (
        ["trainer.schedule=wsd", "trainer.max_steps=30", "trainer.warmup_steps=10", "trainer.decay_steps=25"],
        "trainer.schedule=wsd: trainer.warmup_steps=10 + trainer.decay_steps=25 exceed trainer.max_steps=30",
    ),
    (
        ["trainer.schedule=wsd", "trainer.max_steps=10", "trainer.warmup_steps=9", "trainer.decay_fraction=0.5"],
        "trainer.warmup_steps=9 + trainer.decay_fraction=0.5 (5 steps) exceed trainer.max_steps=10",
    ),
    (["trainer.schedule=custom"], "trainer.schedule=custom needs trainer.schedule_fn={_target_: "),
    (
        ["trainer.schedule=custom", "trainer.schedule_fn={_target_: user_models.nowhere}"],
        "trainer.schedule_fn._target_=user_models.nowhere: ",
    ),
    (
        ["trainer.schedule=custom", "trainer.schedule_fn={_target_: user_models.step_halving, every: 0}"],
        "trainer.schedule_fn._target_=user_models.step_halving: ZeroDivisionError",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides,line", REFUSED)
def test_phases_that_do_not_fit_and_a_schedule_function_that_fails_are_one_line(
    overrides: list[str], line: str, tmp_path
) -> None:
    from conftest import TINY, cli_here

    proc = cli_here(tmp_path, *TINY, *overrides)
    assert proc.returncode != 0
    (error,) = [e for e in proc.stderr.splitlines() if e.strip()]
    assert line in error, error
