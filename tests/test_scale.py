"""The launcher at 16 and 32 nodes on loopback, through bench/scale.py's modes: 32 launchers, each a one-rank node of
one job (c10d rendezvous, one shared run directory), train and save, and 8 resume that run directory exactly
(--check); an elastic job of 14 to 16 nodes refuses a 17th and goes on at 14 after 2 are killed, exactly (--elastic);
one fault among 32 nodes is one line on each naming the rank at fault (--faults). Minutes each on 2 cores: marked
`scale`, left out of the usual run (`python -m pytest -m scale` runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(tmp_path: Path, *args: str) -> str:
    """bench/scale.py with `args`, its runs in `tmp_path`: its output, once it exited 0 (its checks passed)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3500,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    return run.stdout


@pytest.mark.scale
@pytest.mark.timeout(3600)
def test_32_one_rank_nodes_equal_one_process_and_resume_exactly_on_8(tmp_path: Path) -> None:
    out = bench(tmp_path, "--check", "--nodes", "32", "--resume-nodes", "8", "--steps", "6")
    assert "exact: 32 nodes then 8 nodes against one process" in out, out


@pytest.mark.scale
@pytest.mark.timeout(3600)
def test_an_elastic_job_of_16_refuses_a_17th_and_goes_on_exactly_at_14_after_2_are_killed(tmp_path: Path) -> None:
    out = bench(tmp_path, "--elastic")
    assert "exact: nodes=14:16, 16 nodes then 14 after 2 were killed" in out, out


@pytest.mark.scale
@pytest.mark.timeout(3600)
def test_one_fault_among_32_nodes_is_one_line_on_each_naming_the_rank_at_fault(tmp_path: Path) -> None:
    out = bench(tmp_path, "--faults")
    assert "32 of 32 name rank 20" in out, out
