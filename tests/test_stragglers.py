"""Stragglers, named (`launcher/telemetry/stragglers.py`): each logged step's compute and wait per rank, and one line
naming a rank that keeps the others waiting for several logged steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, Run, launch

from launcher.telemetry.stragglers import Stragglers

SLEEP_S = 1.0
"""Seconds rank 1's model sleeps in each training forward: many times the tiny model's step, so that rank 0's own
compute, slowed by whatever else the machine runs, stays under half of rank 1's (FRACTION) in every logged step."""
FRACTION = 1.0
"""The runs' trainer.straggler_fraction: twice the other rank's compute, a margin no scheduling noise of a busy CI
machine crosses three logged steps in a row, and that a forward sleeping SLEEP_S crosses many times over."""


def _step(compute: list[float], data: list[float] | None = None, wait: list[float] | None = None) -> list[list[float]]:
    """One logged step's rows, a row per rank, as `over_ranks(each=...)` returns them: [data_s, wait_s, compute_s]."""
    data = data or [0.01] * len(compute)
    wait = wait or [max(compute) - c for c in compute]  # the others wait for the slowest
    return [[d, w, c] for d, w, c in zip(data, wait, compute)]


SLOW_1 = _step([0.1, 0.5, 0.1])
EVEN = _step([0.1, 0.1, 0.1])


@pytest.mark.unit
def test_a_rank_slower_than_the_median_for_several_logged_steps_is_named_once_until_it_recovers() -> None:
    watch = Stragglers(0.2, 3, host=lambda rank: {1: "node-b"}.get(rank))
    assert [watch.see(SLOW_1) for _ in range(2)] == [None, None]  # not yet: 2 logged steps of 3
    line = watch.see(SLOW_1)
    assert line == (
        "launch: rank 1 (on node-b) is a straggler: 0.5 s computing per step against a median of 0.1 s on the other "
        "ranks over the last 3 logged steps; the difference is in its forward/backward and optimizer step, not in "
        "reading its batches (0.01 s against 0.01 s); the other ranks wait for it in collectives (0.4 s per step)"
    )
    assert [watch.see(SLOW_1) for _ in range(5)] == [None] * 5  # said once, not every step
    assert watch.see(EVEN) is None  # recovered
    assert [watch.see(SLOW_1) is not None for _ in range(3)] == [False, False, True]  # and straggles again: said again


@pytest.mark.unit
def test_a_streak_is_of_one_rank_in_logged_steps_in_a_row() -> None:
    watch = Stragglers(0.2, 3)
    slow_2 = _step([0.1, 0.1, 0.5])
    seen = [watch.see(rows) for rows in (SLOW_1, SLOW_1, slow_2, SLOW_1, SLOW_1, EVEN, SLOW_1, SLOW_1)]
    assert seen == [None] * 8  # never three in a row of the same rank
    assert watch.see(SLOW_1) is not None and "rank 1 is a straggler" in watch.line(1)  # no host known: none named


@pytest.mark.unit
def test_below_the_fraction_with_the_watch_off_or_alone_no_rank_is_named() -> None:
    slightly = _step([0.1, 0.115, 0.1])  # 15% over the median: under 20%
    assert all(Stragglers(0.2, 1).see(slightly) is None for _ in range(5))
    off = Stragglers(0.0, 1)  # trainer.straggler_fraction=0 (or null)
    assert all(off.see(SLOW_1) is None for _ in range(5))
    assert Stragglers(0.2, 1).see([[0.01, 0.0, 0.5]]) is None  # one rank: nobody to be slower than
    # The median of the *other* ranks: with two ranks, one against the other (their mean would halve the excess).
    assert Stragglers(0.2, 1).see(_step([0.1, 0.13])) is not None


@pytest.mark.unit
def test_a_rank_slow_reading_its_batches_is_told_so() -> None:
    watch = Stragglers(0.2, 2)
    rows = _step([0.1, 0.5, 0.1], data=[0.01, 0.41, 0.01])
    assert watch.see(rows) is None
    line = watch.see(rows)
    assert line is not None and "; most of the difference is reading its batches (0.41 s against 0.01 s);" in line


def _slow_run(tmp_path: Path, sleep_s: float, name: str) -> Run:
    """2 CPU ranks (gloo) of the tiny GPT whose training forward sleeps `sleep_s` on rank 1; 4 logged steps."""
    return launch(
        tmp_path,
        *TINY,
        "gpus=2",
        "batch.global_size=8",
        "batch.micro_size=4",
        "trainer.max_steps=4",
        "trainer.save_at_end=false",
        "model._target_=faulty.SlowGPT",
        f"+model.sleep_s={sleep_s}",
        f"trainer.straggler_fraction={FRACTION}",
        "trainer.straggler_steps=3",
        name=name,
    ).check()


def _straggler_lines(run: Run) -> list[str]:
    return [line for line in run.stdout.splitlines() if "is a straggler" in line]


def test_a_rank_that_sleeps_in_forward_is_named_once_and_the_others_wait_for_it(tmp_path: Path) -> None:
    run = _slow_run(tmp_path, SLEEP_S, "slow")
    figures = {
        m["step"]: {k: m[k] for k in ("compute_s_max", "compute_s_rank", "wait_s_max", "wait_s_rank")}
        for m in run.metrics
    }
    assert list(figures) == [1, 2, 3, 4]
    assert all(f["compute_s_rank"] == 1 and f["wait_s_rank"] == 0 for f in figures.values()), figures
    # Lower bounds the sleep itself sets: rank 1 computes at least that long, and rank 0, done with its forward
    # first, waits in the probe for most of it.
    assert all(f["compute_s_max"] > SLEEP_S and f["wait_s_max"] > SLEEP_S / 2 for f in figures.values()), figures
    lines = _straggler_lines(run)
    assert len(lines) == 1, run.stdout  # named at step 3, not again at step 4
    assert lines[0].startswith("launch: rank 1 (on "), lines
    assert "over the last 3 logged steps; the difference is in its forward/backward and optimizer step" in lines[0]
    computing, median = (float(lines[0].split(s)[1].split(" s")[0]) for s in (") is a straggler: ", "a median of "))
    assert computing > (1 + FRACTION) * median, lines  # the relation the line was printed for


def test_a_run_without_a_straggler_names_none(tmp_path: Path) -> None:
    run = _slow_run(tmp_path, 0.0, "even")
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    assert all({"compute_s_max", "compute_s_rank", "wait_s_max", "wait_s_rank"} <= m.keys() for m in run.metrics)
    assert _straggler_lines(run) == [], run.stdout
