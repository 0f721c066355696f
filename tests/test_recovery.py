"""Recovery's edges: nothing of a killed launcher's memory tier is left in shared memory once another launcher starts
on its host; no folder of a live launcher, of a process that reused a dead one's pid, or of another user is touched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch
from processes import until, worker_pids

from launcher.recovery import leftovers
from launcher.recovery import shm as memory


def _tier_of(run_dir: Path, shm: Path = memory.SHM) -> list[Path]:
    run_id = (run_dir / "run_id").read_text().strip()
    return sorted(shm.glob(f"{memory.PREFIX}{run_id}-*"))


def test_a_sigkilled_launcher_s_memory_tier_is_removed_by_the_next_launcher_on_its_host(tmp_path: Path) -> None:
    """A run with the tier on is killed as the out-of-memory killer kills: SIGKILL to its launcher (its worker ends
    with it). Its node's folder stays in /dev/shm, holding a step of its state; the next run started on the host, any
    run, removes it and says so in one line, and nothing of the dead run is left in /dev/shm. Both runs keep the tier in
    a folder of this test's own ($LAUNCH_SHM): the launchers of the tests running beside it clean /dev/shm as well, and
    one of them could take the dead run's folder first."""
    (tmp_path / "slow").touch()
    shm = tmp_path / "shm"
    shm.mkdir()
    env = clean_env(tmp_path) | {memory.SHM_ENV: str(shm)}
    run_dir = tmp_path / "killed"
    slow = [
        "model._target_=faulty.SlowGPT",
        "+model.sleep_s=0.2",
        "+model.slow_rank=0",
        f"+model.while_there={tmp_path / 'slow'}",
    ]
    proc = subprocess.Popen(
        [
            LAUNCH,
            *TINY,
            *slow,
            "strategy=fsdp",  # sharded: the tier copies each step (under ddp the state itself is the copy)
            "trainer.max_steps=10000",
            "trainer.memory_checkpoint_every=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(
            lambda: (
                (run_dir / "run_id").exists() and any(list(f.glob("step_*/*.distcp")) for f in _tier_of(run_dir, shm))
            ),
            proc,
            what="a step in the memory tier",
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    until(lambda: worker_pids(run_dir) == {}, what="the worker's end")
    (left,) = _tier_of(run_dir, shm)  # what the killed launcher left: its node's folder, a step of state in it
    assert any(left.glob("step_*/*.distcp")), sorted(left.rglob("*"))
    (tmp_path / "slow").unlink()
    after = launch(tmp_path, *TINY, "trainer.max_steps=1", name="next", env=env)
    assert after.returncode == 0, after.stderr[-3000:]
    said = [line for line in after.stdout.splitlines() if line.startswith("launch: removed ")]
    assert len(said) == 1 and left.name in said[0], after.stdout
    assert f"memory-tier folder(s) in {shm} whose launcher no longer runs on this host" in said[0], said
    assert _tier_of(run_dir, shm) == []
    assert list(shm.glob(f"launch-failures-{proc.pid}-*")) == []  # its failure folder too (empty)


def _folder(shm: Path, name: str, owner: dict[str, object] | None) -> Path:
    folder = shm / f"{memory.PREFIX}{name}"
    (folder / "step_00000001").mkdir(parents=True)
    (folder / "step_00000001" / "__0_0.distcp").write_bytes(b"x" * 1000)
    if owner is not None:
        (folder / leftovers.OWNER).write_text(json.dumps(owner))
    return folder


@pytest.mark.unit
def test_only_folders_whose_launcher_is_gone_are_removed(tmp_path: Path) -> None:
    """A live launcher's folder stays; one whose pid now runs another process (another start time) goes, as does an
    unclaimed one whose pid no process has; another host's, another boot's and an unreadable record stay, and so
    does another user's."""
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has (now)
    me = leftovers.identity()
    assert me is not None
    live = tmp_path / f"{memory.PREFIX}live-{host}-{os.getpid()}"
    leftovers.claim(live)
    reused = _folder(tmp_path, f"reused-{host}-{os.getpid()}", {**me, "start": me["start"] - 1})
    unclaimed = _folder(tmp_path, f"old-{host}-{dead.pid}", None)
    unclaimed_live = _folder(tmp_path, f"oldlive-{host}-{os.getpid()}", None)
    elsewhere = _folder(tmp_path, f"there-other-{dead.pid}", {**me, "host": "other", "pid": dead.pid})
    rebooted = _folder(tmp_path, f"boot-{host}-{dead.pid}", {**me, "boot": "another", "pid": dead.pid})
    damaged = _folder(tmp_path, f"bad-{host}-{dead.pid}", None)
    (damaged / leftovers.OWNER).write_text("{not json")
    theirs = _folder(tmp_path, f"theirs-{host}-{dead.pid}", None)
    if os.geteuid() == 0:  # another user's (only root can make one): never judged
        os.chown(theirs, 4242, -1)
    else:
        theirs.rename(theirs := theirs.with_name(f"{theirs.name}x"))  # (as another user: a name no launcher has)
    line = leftovers.remove_left_over(tmp_path)
    assert line == (
        f"launch: removed 2 memory-tier folder(s) in {tmp_path} whose launcher no longer runs on this host "
        f"({unclaimed.name}, {reused.name}): 0.0 MB freed"
    )
    assert not reused.exists() and not unclaimed.exists()
    for kept in (live, unclaimed_live, elsewhere, rebooted, damaged, theirs):
        assert kept.is_dir(), kept
    assert json.loads((live / leftovers.OWNER).read_text()) == me
    assert leftovers.remove_left_over(tmp_path) is None  # nothing left to remove: nothing said


def test_under_ddp_the_tier_copies_nothing_per_step_and_a_survivor_s_state_is_the_copy(tmp_path: Path) -> None:
    """Two ddp ranks with the tier on: while they train, their node's folder holds the last step's number and no state
    at all (every rank holds the whole state: nothing is copied per step). Rank 1's worker is then SIGKILLed: rank 0,
    whose collective fails, writes its own state once, and the restarted group resumes from it, none replayed.
    (Exactness: test_memory_tier's rank killed alone, and its lost node, both under ddp.)"""
    from test_memory_tier import RESUMED

    (tmp_path / "slow").touch()
    run_dir = tmp_path / "ddp"
    proc = subprocess.Popen(
        [
            LAUNCH,
            *TINY,
            "model._target_=faulty.SlowGPT",
            "+model.sleep_s=0.3",
            "+model.slow_rank=0",
            f"+model.while_there={tmp_path / 'slow'}",
            "gpus=2",
            "batch.global_size=8",
            "trainer.max_steps=12",
            "trainer.max_restarts=1",
            "trainer.memory_checkpoint_every=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    try:
        until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc, what="three steps")
        (folder,) = _tier_of(run_dir)
        assert (folder / memory.LAST).is_file() and list(folder.glob("step_*")) == [], sorted(folder.rglob("*"))
        os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
        (tmp_path / "slow").unlink()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    said = RESUMED.search(out)
    assert said and said.group(2) == "memory" and said.group(3) == "0", out[-3000:]
    assert f"launch: memory tier: rank 0: step {said.group(1)} written" in out, out[-3000:]
    assert _tier_of(run_dir) == []


@pytest.mark.unit
def test_a_replica_s_state_counts_only_as_the_step_it_last_completed(tmp_path: Path) -> None:
    """torch's step hooks count the optimizer's updates: once one ran past the step noted (the failure came between an
    update and its step's end), nothing is written; at the step's end, the state is written once per node, and the
    restart picks that step from any node that holds it."""
    import torch

    from launcher.checkpoint.format import Position
    from launcher.recovery.replicas import Replica

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    class Held:  # a strategy's two methods the replica reads: every rank holds all of this state
        def state_dict(self) -> dict[str, object]:
            return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    replica = Replica(optimizer)
    folder = tmp_path / "node"
    assert replica.write(folder, Held(), 1, 4, {}) == "no step complete yet: nothing written"
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    replica.ended(Position(7, 84), {"torch": torch.get_rng_state()})
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # step 8's update, and then the failure, before step 8 ended
    said = replica.write(folder, Held(), 1, 4, {})
    assert said == "the state is past step 7 (an optimizer update under way or done): nothing written"
    assert not folder.exists()
    replica.ended(Position(8, 96), {"torch": torch.get_rng_state()})
    assert replica.write(folder, Held(), 1, 4, {}).startswith("step 8 written, ")
    assert replica.write(folder, Held(), 3, 4, {}) == "step 8 claimed by another rank of this node"
    views = {"n0": memory.held(folder), "n2": {"steps": {}, "last": [8, 1.0]}}
    assert memory.choose(views) == (8, {"1": "n0"}, "")  # one replica's whole state: every rank's
    (marker,) = views["n0"]["steps"][8].values()
    assert marker["whole"] and marker["world_size"] == 4 and marker["samples"] == 96
