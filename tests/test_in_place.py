"""Recovery in place (trainer.recovery=in_place): what it refuses before start, and how a survivor breaks the
collectives of a group whose peer is gone, which gloo cannot abort. The whole recovery (four one-rank nodes, one lost,
three going on in their processes, every loss one process's) is the scale tier's
`test_memory_tier.py::test_a_lost_node_costs_no_step_and_the_job_goes_on_exactly_at_3_nodes`."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY, launch_here

from launcher.base.collectives import failed_collective
from launcher.recovery.in_place import GlooSockets

ON = ["trainer.recovery=in_place", "device=cpu"]


def test_in_place_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """One line each, before any worker starts: one rank, a strategy that cannot be set up again in its process
    (DeepSpeed's engine), a pipeline (a lost stage's layers are no survivor's), a job of fixed nodes (none can be
    lost and the job go on)."""
    assert launch_here(tmp_path, *TINY, *ON, "gpus=1", name="one").refused() == (
        "launch: error: trainer.recovery=in_place needs more than one rank; this job has 1: "
        "set trainer.recovery=restart"
    )
    said = launch_here(tmp_path, *TINY, *ON, "gpus=2", "strategy=zero2", name="zero2").refused()
    assert said.startswith("launch: error: trainer.recovery=in_place: ") and said.endswith(
        "cannot be set up again in the same process on a new process group (DeepSpeed's engine keeps the groups it "
        "was made with); set trainer.recovery=restart, or use ddp, fsdp or hsdp"
    ), said
    said = launch_here(tmp_path, *TINY, *ON, "gpus=2", "strategy=fsdp", "strategy.pp_size=2", name="pp").refused()
    assert said == (
        "launch: error: trainer.recovery=in_place with strategy.pp_size > 1: a lost stage's layers are no survivor's; "
        "set trainer.recovery=restart"
    ), said
    said = launch_here(tmp_path, *TINY, *ON, "gpus=2", name="fixed").refused()
    assert said == (
        "launch: error: trainer.recovery=in_place goes on with the nodes left, but this job has one node (its "
        "launcher restarts a lost rank's group itself): run it on several nodes, nodes=MIN:MAX, or set "
        "trainer.recovery=restart"
    ), said
    fixed = ["nodes=2", "gpus=1", "rdzv.endpoint=127.0.0.1:29999", "rdzv.id=x"]
    said = launch_here(tmp_path, *TINY, *ON, *fixed, name="two").refused()
    assert said == (
        "launch: error: trainer.recovery=in_place goes on with the nodes left, but nodes=2 is fixed: make the job "
        "elastic (nodes=MIN:2 with MIN < 2, trainer.max_restarts=N), or set trainer.recovery=restart"
    ), said
    assert not any((tmp_path / name / "resolved.yaml").exists() for name in ("one", "zero2", "pp", "fixed", "two"))


def _rank(rank: int, port: int, shut: bool, errors: dict[int, str]) -> None:
    """Four gloo ranks in a loop of all-reduces; rank 3 is SIGKILLed in the third. Its neighbours see it at once; rank
    1 waits on them. Each survivor, on its error, shuts its group's connections down (as `InPlace.regroup` does) where
    `shut`, then reports the error it got."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    inherited = GlooSockets.now()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("g", store), rank=rank, world_size=4, timeout=datetime.timedelta(seconds=20)
    )
    sockets = GlooSockets(inherited)  # the store's connections (and rank 0's server) are kept
    store.set(f"ports{rank}", ",".join(map(str, sockets.listeners())))
    dist.barrier()
    ports = {int(p) for r in range(4) for p in store.get(f"ports{r}").decode().split(",") if p}
    try:
        for i in range(100):
            if rank == 3 and i == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost peer: its sockets closed by the kernel
            dist.all_reduce(torch.ones(1 << 18))
    except Exception as e:
        assert failed_collective(e), repr(e)
        closed = sockets.shut(ports) if shut else 0  # gloo closes a pair that failed: the others are shut here
        errors[rank] = (str(e).splitlines()[0], closed)
        # The store still answers (its connection was kept); each survivor holds its group, as one waiting for the
        # membership does, until every survivor's collective failed: a wait that only a closed connection ends.
        store.add("failed", 1)
        while store.add("failed", 0) < 3:
            time.sleep(0.01)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_survivor_s_shut_connections_end_every_other_survivor_s_wait_at_once() -> None:
    """gloo has no abort: a survivor whose collective failed and moved on leaves a peer that waits on it for the whole
    collective timeout. Shut down by the failing survivor (its gloo connections, told by the job's listener ports),
    every other survivor's collective fails too, with a closed connection, not a timeout; the store's connection,
    which recovery needs, is kept."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    errors = manager.dict()
    ranks = [mp.get_context("spawn").Process(target=_rank, args=(r, port, True, errors)) for r in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(100)
    assert [p.exitcode for p in ranks] == [0, 0, 0, -signal.SIGKILL]
    assert sorted(errors.keys()) == [0, 1, 2]
    for rank, (error, _) in errors.items():
        assert "Timed out" not in error, (rank, error)
