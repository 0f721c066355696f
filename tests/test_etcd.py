"""rdzv.backend=etcd-v2: torch's etcd rendezvous, its store in a real etcd server (Debian's, started on loopback by
the tests), so that no node of a job is the one it cannot lose; and its settings refused before start where they
could only stall."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, etcd_server, launch_here
from nodes import ELASTIC, beside_one, ended_on_exit, job_nodes, kill_nodes, outputs, went_on_exactly
from processes import until


@pytest.mark.long  # two launchers and one process on loopback
@pytest.mark.timeout(600)
def test_the_node_of_rank_0_lost_the_job_goes_on_exactly_with_its_rendezvous_in_etcd(tmp_path: Path, etcd: str) -> None:
    """Two one-rank ddp nodes (nodes=1:2) meet in etcd. The node of rank 0 is SIGKILLed whole mid-step 3: under c10d
    the node a job cannot lose is the one hosting the store (tests/test_faults.py: its survivor ends), here no node
    hosts it. The node left meets again in etcd, resumes from step 2 promoted from its memory (ddp: its own state is
    the copy), none replayed, and finishes alone; every loss is one process's; nothing is left in /dev/shm."""
    shape = ["batch.global_size=12", "trainer.max_steps=6"]  # accumulation 6 at 2 ranks, 12 at 1
    (tmp_path / "kill").touch()  # rank 0 kills its node mid-step 3 (its second forward of 6), once
    killer = ["+model.bad_rank=0", "+model.at_call=14", "+model.whole_node=true"]
    nodes, run_dir = job_nodes(tmp_path, "etcd", "1:2", [*shape, *killer], count=2, etcd=etcd)
    with ended_on_exit(nodes):
        until(lambda: not (tmp_path / "kill").exists(), *nodes[1:], what="the node's loss")
        kill_nodes(run_dir, nodes, [0])
        # One process's run while the node left meets etcd again.
        codes, one = beside_one(tmp_path, nodes, [*ELASTIC, *shape, "batch.micro_size=4", "gpus=1"], timeout=400)
    out = outputs(tmp_path, "etcd", count=2)
    assert codes == [0], out[-4000:]
    assert f"it outlives any of its nodes (the rendezvous store is etcd's, at rdzv.endpoint={etcd})" in out, out[:3000]
    rows = went_on_exactly(out, run_dir, one, resumed=2, steps=6)
    assert [r["world_size"] for r in rows] == [2, 2, 1, 1, 1, 1], rows


JOB = [
    *TINY,
    "nodes=2:3",
    "gpus=1",
    "batch.global_size=24",
    "trainer.max_restarts=3",
    "rdzv.backend=etcd-v2",
    "rdzv.id=job",
]


def test_an_etcd_rendezvous_nothing_answers_is_one_line_before_any_worker(tmp_path: Path) -> None:
    """No endpoint, nothing listening at it: each refused in one line naming it, before anything is written."""
    import socket

    line = launch_here(tmp_path, *TINY, "rdzv.backend=etcd-v2").refused()
    assert "rdzv.backend=etcd-v2 needs rdzv.endpoint=HOST:PORT, the client address of an etcd server" in line, line
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    line = launch_here(tmp_path, *JOB, f"rdzv.endpoint={closed}").refused()
    assert line.startswith(f"launch: error: rdzv.endpoint={closed}: no etcd answers there ("), line


def test_an_etcd_without_its_v2_api_is_one_line_before_any_worker(tmp_path: Path) -> None:
    """etcd's default since 3.4 (its v2 API off), which torch's etcd rendezvous cannot speak to: refused in one line
    saying how to start it, before anything is written."""
    with etcd_server(v2=False) as v3_only:
        line = launch_here(tmp_path, *JOB, f"rdzv.endpoint={v3_only}").refused()
    assert line == (
        f"launch: error: rdzv.endpoint={v3_only}: the etcd there has no v2 API, which torch's etcd rendezvous "
        "speaks; start it with --enable-v2=true (etcd 3.4 or 3.5: 3.6 has none)"
    ), line
