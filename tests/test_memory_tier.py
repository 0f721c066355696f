"""The memory tier (trainer.memory_checkpoint_every): each step's state in its node's shared memory and a peer's; a
restart resumes from the newest step complete across the nodes left, exactly, at any world size, in one line; no
shared memory is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import TINY, launch, launch_here
from nodes import (
    ELASTIC,
    RESUMED,
    beside_one,
    ended_on_exit,
    job_nodes,
    kill_nodes,
    left_in_shm,
    node_launcher,
    outputs,
    rows_of,
    went_on_exactly,
    worst_loss,
)
from processes import until

from launcher.recovery import shm as memory


def test_a_rank_killed_alone_resumes_from_its_own_node_s_memory_exactly(tmp_path: Path) -> None:
    """Two ranks on one node; rank 1 is SIGKILLed mid-step (its node's launcher alive). The restarted group resumes
    from the step before, promoted from the node's shared memory: no step replayed, every loss an uninterrupted run's,
    and the node's folder in /dev/shm gone once the job ends."""
    (tmp_path / "kill").touch()
    shape = [*TINY, "gpus=2", "batch.global_size=8", "trainer.max_steps=10", "trainer.save_at_end=false"]
    faulty = [
        "model._target_=faulty.KilledOnceGPT",
        "+model.sleep_s=0.3",
        f"+model.while_there={tmp_path / 'kill'}",
        "+model.bad_rank=1",
        "+model.at_call=6",
        "trainer.max_restarts=1",
        "trainer.memory_checkpoint_every=1",
    ]
    run = launch(tmp_path, *shape, *faulty, name="killed")
    assert run.returncode == 0, run.stderr[-3000:]
    reference = launch(tmp_path, *shape, name="reference")
    assert reference.returncode == 0, reference.stderr
    said = RESUMED.search(run.stdout)
    assert said and said.group(2) == "memory" and said.group(3) == "0", run.stdout
    rows, expected = rows_of(tmp_path / "killed"), {int(r["step"]): r["loss"] for r in rows_of(tmp_path / "reference")}
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, 11)) and int(said.group(1)) == 5, steps  # killed in step 6: none replayed
    assert worst_loss(rows, expected) <= 1e-6
    assert left_in_shm(tmp_path / "killed") == []


def test_zero2_s_state_is_copied_when_nothing_read_it_before_the_first_step(tmp_path: Path) -> None:
    """ZeRO-2 on two ranks, the tier on and no save to disk due: nothing takes the state before the first step (a
    save's room check would), so the tier's copy after step 1 is the first read of the optimizer state, in the group
    with weight decay too, whose moments DeepSpeed's first step left unlinked to its parameters."""
    shape = ["strategy=zero2", "gpus=2", "batch.global_size=4", "batch.micro_size=2", "trainer.max_steps=2"]
    run = launch(tmp_path, *TINY, *shape, "trainer.save_at_end=false", "trainer.memory_checkpoint_every=1")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert [int(r["step"]) for r in run.metrics] == [1, 2]
    assert left_in_shm(run.run_dir) == []


def test_a_lost_node_replaced_costs_no_step_and_every_loss_is_one_process_s(tmp_path: Path) -> None:
    """The tier's headline at its cheapest: a ddp job of two one-rank nodes; the node of rank 1 is SIGKILLed whole in
    step 3, its shared memory gone with it, and a fresh node takes its place, as a cluster restarts one. Under ddp
    every rank holds the whole state: the tier makes no copy per step, and the survivor writes its own state (step 2's)
    once, when its collective fails. The job resumes from step 2, promoted from the memory of the node left, none
    replayed; every loss is one process's; no shared memory is left. (The scale tier loses one node of
    four under ddp, fsdp and zero2 and goes on at three, and loses two adjacent ones.)"""
    shape = ["batch.global_size=4", "trainer.max_steps=4"]  # accumulation 2
    (tmp_path / "kill").touch()  # rank 1 kills its node mid-step 3 (its second forward), once
    killer = ["+model.bad_rank=1", "+model.at_call=6", "+model.whole_node=true"]
    nodes, run_dir = job_nodes(tmp_path, "lost", "2", [*shape, *killer], count=2)
    with ended_on_exit(nodes):
        until(lambda: not (tmp_path / "kill").exists(), *nodes[:1], what="the node's loss")
        kill_nodes(run_dir, nodes, [1])
        nodes.append(node_launcher(tmp_path, "lost2", nodes[0].args))  # the node that takes its place
        # One process's run while torch waits to drop the lost node (~15 s).
        codes, one = beside_one(tmp_path, nodes, [*ELASTIC, *shape, "batch.micro_size=4", "gpus=1"], timeout=300)
    out = outputs(tmp_path, "lost", count=3)
    assert codes == [0, 0], out[-4000:]
    went_on_exactly(out, run_dir, one, resumed=2, steps=4)
    # ddp: the survivor's own state was the copy, written once when the step in flight failed (no per-step copy)
    assert "launch: memory tier: rank 0: step 2 written" in out, out[-4000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """One process at the same global batch: every strategy's, every world size's losses (fp32, CPU)."""
    tmp = tmp_path_factory.mktemp("reference")
    run = launch(tmp, *ELASTIC, "batch.micro_size=4", "gpus=1", name="one")
    assert run.returncode == 0, run.stderr
    return {int(r["step"]): r["loss"] for r in rows_of(tmp / "one")}


IN_PLACE = re.compile(r"launch: recovery in place: rank\(s\) 3 lost; 3 rank\(s\) go on in their processes")


@pytest.mark.scale  # four launchers on loopback, a minute each on 2 cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("strategy", "recovery"), [("ddp", "in_place"), ("fsdp", "in_place"), ("zero2", "restart")])
def test_a_lost_node_costs_no_step_and_the_job_goes_on_exactly_at_3_nodes(
    tmp_path: Path, strategy: str, recovery: str, uninterrupted: dict[int, float]
) -> None:
    """Four one-rank nodes (nodes=3:4); one is SIGKILLed whole mid-run. The three left resume from the step before
    the failure, promoted from their memory (the lost node's state from its replica), none replayed, and finish at
    world size 3; every loss is one process's; no shared memory is left. In place (trainer.recovery=in_place) the
    survivors do it in their own processes: one line says so, and no worker group was started again (torch's agent
    counted no restart, and no group at the new size said its batch)."""
    name = f"tier-{strategy}"
    (tmp_path / "kill").touch()  # rank 3 kills its node (launcher and worker) mid-step, once: after 2 forwards of 3
    killer = ["+model.bad_rank=3", "+model.at_call=11", "+model.whole_node=true"]
    nodes, run_dir = job_nodes(tmp_path, name, "3:4", [f"strategy={strategy}", f"trainer.recovery={recovery}", *killer])
    try:
        until(lambda: not (tmp_path / "kill").exists(), *nodes[:1], what="the node's loss")
        kill_nodes(run_dir, nodes, [3])  # its shared memory gone with it, as a lost machine's is
        codes = [n.wait(timeout=600) for n in nodes if n.returncode is None]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    out = outputs(tmp_path, name)
    assert codes == [0, 0, 0], out[-4000:]
    said = RESUMED.search(out)
    assert said and said.group(2) == "memory" and said.group(3) == "0", out[-4000:]
    rows = rows_of(run_dir)
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, 9)), steps  # no step trained twice
    assert {int(r["world_size"]) for r in rows} == {3, 4} and rows[-1]["world_size"] == 3
    assert worst_loss(rows, uninterrupted) <= 1e-6
    assert left_in_shm(run_dir) == []
    assert bool(IN_PLACE.search(out)) == (recovery == "in_place"), out[-4000:]
    if recovery == "in_place":  # no worker group was started again at 3 (rank 0 says its batch when one starts)
        assert {int(r["restart"]) for r in rows} == {0} and "x world size 3 = global" not in out, out[-4000:]


def _worker(node: subprocess.Popen[bytes], rank: int) -> int:
    """The pid of the worker of `rank` in the session of `node`'s launcher (a worker names itself launch-rank<N>)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == f"launch-rank{rank}":
                if os.getsid(int(proc.name)) == node.pid:
                    return int(proc.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no worker of rank {rank} under {node.pid}")


@pytest.mark.scale  # four launchers on loopback
@pytest.mark.timeout(900)
def test_a_rank_that_stops_answering_is_left_out_in_place_and_its_node_rejoins(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    """Rank 3 is SIGSTOPped mid-run (alive, silent: only the collective timeout sees it). The three others give up
    waiting after trainer.collective_timeout, recover in place without it and go on; its node's launcher, told that
    rank 3 was left out, kills it and rejoins the job, which resizes back to four. No node hangs, every step is
    trained once, every loss is one process's."""
    (tmp_path / "kill").touch()
    extra = ["strategy=ddp", "trainer.recovery=in_place", "trainer.collective_timeout=20", "+model.bad_rank=9"]
    nodes, run_dir = job_nodes(tmp_path, "stopped", "3:4", extra)
    try:
        until(lambda: len(rows_of(run_dir)) >= 3, *nodes, what="three steps at 4 nodes")
        node = next(n for n in nodes if n.pid == _launcher_of(run_dir, 3))
        os.kill(_worker(node, 3), signal.SIGSTOP)
        codes = [n.wait(timeout=600) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    out = outputs(tmp_path, "stopped")
    assert codes == [0, 0, 0, 0], out[-4000:]
    assert IN_PLACE.search(out), out[-4000:]
    assert "launch: rank 3 was left out of the job's recovery in place" in out, out[-4000:]
    rows = rows_of(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert 3 in {int(r["world_size"]) for r in rows}
    assert worst_loss(rows, uninterrupted) <= 1e-6
    assert left_in_shm(run_dir) == []


def _launcher_of(run_dir: Path, rank: int) -> int:
    record = json.loads((run_dir / "logs" / "ranks" / f"rank{rank}.json").read_text())
    return int(record["launcher"].split(":")[1])


@pytest.mark.scale  # four launchers on loopback
@pytest.mark.timeout(900)
def test_two_adjacent_nodes_lost_with_one_replica_fall_back_to_disk_saying_so(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    """Ranks 2 and 3 are adjacent in the ring: under fsdp (each rank holds a shard no other does) rank 2's state
    lived on its node and on rank 3's, both lost. The two nodes left say which rank's state no node holds, resume
    from the disk tier, and go on exactly."""
    (tmp_path / "kill").touch()  # slow steps until the test kills
    nodes, run_dir = job_nodes(
        tmp_path,
        "adjacent",
        "2:4",
        ["trainer.checkpoint_every=2", "trainer.memory_replicas=1", "+model.bad_rank=9", "strategy=fsdp"],
    )
    try:
        until(lambda: sum(r["world_size"] == 4 for r in rows_of(run_dir)) >= 3, *nodes, what="three steps at 4 nodes")
        kill_nodes(run_dir, nodes, [2, 3])
        (tmp_path / "kill").unlink()
        codes = [n.wait(timeout=600) for n in nodes if n.returncode is None]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    out = outputs(tmp_path, "adjacent")
    assert codes == [0, 0], out[-4000:]
    # rank 2's state, and rank 3's too where its copy of the newest step had not reached node 0 before the kill
    assert re.search(
        r"launch: memory tier: step \d+ lacks the state of (rank 2|ranks 2, 3) on every node left; "
        r"resuming from the disk tier",
        out,
    ), out[-4000:]
    said = RESUMED.search(out)
    assert said and said.group(2) == "disk", out[-4000:]
    rows = rows_of(run_dir)
    assert rows[-1]["world_size"] == 2 and int(rows[-1]["step"]) == 8
    assert worst_loss(rows, uninterrupted) <= 1e-6
    assert left_in_shm(run_dir) == []


def _view(steps: dict[int, dict[int, str]], last: list[float] | None = None) -> dict[str, object]:
    """A node's `held`: {step: {rank: the node that wrote the rank's files}}, each of a world of 4."""
    return {
        "steps": {s: {r: {"world_size": 4, "node": n} for r, n in ranks.items()} for s, ranks in steps.items()},
        "last": last,
    }


@pytest.mark.unit
def test_the_newest_step_complete_across_the_nodes_left_is_chosen_each_rank_from_its_own_node_first() -> None:
    # a ring of 4 one-rank nodes with one replica: node i keeps rank i and rank i-1; node 3 is lost
    views = {
        f"n{i}": _view({6: {i: f"n{i}", (i - 1) % 4: f"n{(i - 1) % 4}"}, 7: {i: f"n{i}"}}, [7, 100.0 + i])
        for i in range(3)
    }
    step, holders, why = memory.choose(views)
    assert (step, why) == (6, "") and holders == {"0": "n0", "1": "n1", "2": "n2", "3": "n0"}
    assert memory.last_trained(views) == (7, 102.0)
    views.pop("n0")  # two adjacent nodes lost: rank 3's state was on nodes 3 and 0 only
    assert memory.choose(views) == (None, {}, "step 7 lacks the state of ranks 0, 3 on every node left")


@pytest.mark.unit
def test_a_memory_tier_the_job_cannot_hold_is_one_line_before_start(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from launcher.config import ConfigError
    from launcher.recovery.shm import check_memory_tier, replicas

    on = [*TINY, "trainer.memory_checkpoint_every=1"]
    two = ["nodes=2", "gpus=1", "rdzv.endpoint=127.0.0.1:29999", "rdzv.id=x"]
    assert launch_here(tmp_path, *on, "trainer.memory_replicas=1").refused() == (
        "launch: error: trainer.memory_replicas=1 on a single-node job: replicas go to other nodes; set "
        "trainer.memory_replicas=0 (the tier then survives a failed rank, not a lost node)"
    )
    assert launch_here(tmp_path, *on, *two, "trainer.memory_replicas=2").refused() == (
        "launch: error: trainer.memory_replicas=2 needs more than 2 nodes, but nodes=2; set trainer.memory_replicas "
        "to at most 1"
    )
    elastic = ["nodes=2:4", "gpus=1", "rdzv.endpoint=127.0.0.1:29999", "rdzv.id=x", "trainer.max_restarts=1"]
    assert (
        "but nodes=2:4 may run on 2; set trainer.memory_replicas to at most 1"
        in launch_here(
            tmp_path, *on, *elastic, "trainer.memory_replicas=2", "batch.global_size=12", "batch.micro_size=1"
        ).refused()
    )
    trainer = OmegaConf.create({"memory_checkpoint_every": 1, "memory_replicas": None})
    # The default asks for nothing the job lacks: a replica where there is another node, none on one.
    assert [replicas(trainer, k) for k in (1, 2, 3)] == [0, 1, 1]
    check_memory_tier(trainer, 2, 1, 10**6)  # nodes=1:2: not refused for a replica the user never asked for
    with pytest.raises(ConfigError) as e:
        check_memory_tier(trainer, 2, 2, 2 * 10**15)  # 2 PB of state: no /dev/shm holds its half
    line = str(e.value)
    assert line.startswith(
        "the memory tier needs 4000000000.0 MB of shared memory on each node (2 steps x "
        "2000000000.0 MB of state / 2 node(s) x (1 + 1 replica(s))), but /dev/shm has "
    ), line
    assert line.endswith(
        "MB free; enlarge /dev/shm, lower trainer.memory_replicas, or set trainer.memory_checkpoint_every=0"
    ), line
    with pytest.raises(ConfigError) as e:  # ddp: every rank holds the whole state, written once on a failure
        check_memory_tier(trainer, 2, 2, 2 * 10**15, whole=True)
    assert str(e.value).startswith(
        "the memory tier needs 2000000000.0 MB of shared memory on each node (the whole "
        "state, which every rank holds, written once on a failure), but /dev/shm has "
    )
    assert str(e.value).endswith("MB free; enlarge /dev/shm, or set trainer.memory_checkpoint_every=0")


@pytest.mark.unit
def test_launch_plan_shows_the_host_memory_the_tier_takes_pernode_launcher(tmp_path: Path) -> None:
    from conftest import cli_here

    from launcher.plan.render import _size

    args = ["plan", *TINY, "nodes=2", "gpus=2", "trainer.memory_checkpoint_every=1"]
    table = cli_here(tmp_path, *args)
    assert table.returncode == 0, table.stderr
    (line,) = [line for line in table.stdout.splitlines() if line.startswith("memory tier")]
    plan = json.loads(cli_here(tmp_path, *args, "plan.format=json").stdout)
    state = {
        row["name"]: sum(b for kinds in row["state_bytes"].values() for kind, b in kinds.items() if kind != "grads")
        for row in plan["strategies"]
    }
    job = state["ddp"]  # DDP's ranks hold the job's state alike: DCP writes it once, spread over the ranks
    assert state["fsdp"] * 4 == pytest.approx(job)  # FSDP's 4 ranks hold a quarter each
    # fsdp, each node: two steps of half the job's state, and a replica of a peer's; ddp: the whole state, once
    assert f"fsdp {_size(2 * -(-int(job) // 2) * (1 + 1))}" in line, line
    assert f"ddp {_size(int(job))} (the whole state, once, on a failure)" in line, line
    assert "(2 steps x the job's state / 2 node(s) x (1 + 1 replica(s)), where ranks shard it)" in line, line
