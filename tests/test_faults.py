"""Faults that tell the truth: checkpoints that prove themselves (checksums, one order), space counted as written,
a full disk, a refused run, a lost node and a hung rank, each said in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch, launch_here, unavailable
from processes import free_port, listening, until

REPO = Path(__file__).parents[1]

SAVE_PROBE = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from launcher.checkpoint.format import Position
from launcher.checkpoint.saving import Saver
from launcher.checkpoint.space import checkpoint_bytes

root = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)

class State:
    def __init__(self):
        torch.manual_seed(0)
        self.model = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
        self.optim = {"state": {k: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 64)} for k in self.model},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": list(self.model)}]}

    def state_dict(self):
        return {"model": self.model, "optim": self.optim}

state = State()
ck = root / "ckpt"
ck.mkdir()
sync = Saver(ck, 0, 1, keep_last=0)
sync.save(Position(1, 8), state, {"world_size": 1, "config_hash": "0" * 16})
asyn = Saver(ck, 0, 1, keep_last=0, asynchronous=True)
asyn.save(Position(2, 16), state, {"world_size": 1, "config_hash": "0" * 16})
asyn.finish()
print(json.dumps({"estimate": checkpoint_bytes(state.state_dict(), 1)}))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """Two checkpoints of one process, step 1 saved synchronously and step 2 asynchronously; the space estimate."""
    root = tmp_path_factory.mktemp("saved")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_PROBE, str(root)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return root / "ckpt", json.loads(proc.stdout.strip().splitlines()[-1])["estimate"]


def _copy(saved: tuple[Path, int], tmp_path: Path) -> Path:
    shutil.copytree(saved[0], tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def _flip(file: Path, at: float = 0.5, count: int = 16) -> None:
    """Flip `count` bytes at fraction `at` of the file: its size stays, its contents do not."""
    data = bytearray(file.read_bytes())
    start = int(len(data) * at)
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    file.write_bytes(bytes(data))


def test_every_file_has_the_checksum_of_its_bytes_computed_as_written(saved: tuple[Path, int]) -> None:
    from launcher.checkpoint.format import checksum, damage

    for step in (1, 2):  # synchronous, then asynchronous (hashed by the background writer)
        folder = saved[0] / f"step_{step:08d}"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert set(manifest["xxh3_128"]) == set(manifest["files"]) == {".metadata", "__0_0.distcp", "rng_0.pt"}
        assert all(manifest["xxh3_128"][n] == checksum(folder / n) for n in manifest["files"]), folder
        assert damage(folder) is None


def test_space_is_counted_as_written(saved: tuple[Path, int]) -> None:
    """The estimate covers what a checkpoint takes on disk (its blocks), with less than a tenth to spare."""
    folder, estimate = saved[0] / "step_00000001", saved[1]
    on_disk = sum(os.stat(p).st_blocks * 512 for p in folder.iterdir())
    assert on_disk <= estimate <= 1.1 * on_disk, (on_disk, estimate)


@pytest.mark.parametrize(
    ("harm", "file", "why"),
    [
        (
            "flip",
            "__0_0.distcp",
            "__0_0.distcp fails its checksum (xxh3-128): its bytes changed after they were written",
        ),
        ("truncate", "__0_0.distcp", "__0_0.distcp is truncated: {size} bytes recorded, {cut} on disk"),
        ("header", ".metadata", ".metadata fails its checksum (xxh3-128): its bytes changed after they were written"),
        ("header", "rng_0.pt", "rng_0.pt fails its checksum (xxh3-128): its bytes changed after they were written"),
        ("remove", "rng_0.pt", "rng_0.pt is unreadable (No such file or directory)"),
    ],
)
def test_a_damaged_checkpoint_is_never_used_and_each_fallback_says_why(
    saved: tuple[Path, int], tmp_path: Path, harm: str, file: str, why: str
) -> None:
    from launcher.checkpoint.format import CheckpointError, find_checkpoint, newest_intact
    from launcher.checkpoint.loading import find_resume

    checkpoints = _copy(saved, tmp_path)
    newest, older = checkpoints / "step_00000002", checkpoints / "step_00000001"
    target = newest / file
    size = target.stat().st_size if target.exists() else 0
    if harm == "flip":
        _flip(target)
    elif harm == "header":
        _flip(target, at=0.0, count=4)
    elif harm == "truncate":
        os.truncate(target, size // 2)
    else:
        target.unlink()
    line = f"launch: skipping checkpoint {newest}: {why.format(size=size, cut=size // 2)}"
    said: list[str] = []
    assert newest_intact(checkpoints, said.append) == older and said == [line]
    # resume=<run dir> falls back, saying so; resume=<the step folder> and convert refuse it with the same words
    assert find_resume(str(tmp_path), tmp_path / "new", {"config_hash": "0" * 16}) == older
    for refuse in (lambda: find_resume(str(newest), tmp_path / "new", {}), lambda: find_checkpoint(newest)):
        with pytest.raises(CheckpointError) as refused:
            refuse()
        assert (
            str(refused.value) == f"checkpoint {newest} is damaged: {line.split(': ', 2)[2]}; resume from another one"
        )


def _made(checkpoints: Path, step: int, at: float) -> Path:
    """A checkpoint folder as a save leaves it (one small file, its manifest), saved at time `at`."""
    from launcher.checkpoint.format import checksum

    folder = checkpoints / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "rng_0.pt").write_bytes(bytes([step]) * 7)
    record = {"step": step, "samples": 8 * step, "world_size": 1, "time": at, "config_hash": "0" * 16}
    files = {"rng_0.pt": 7}, {"rng_0.pt": checksum(folder / "rng_0.pt")}
    (folder / "manifest.json").write_text(json.dumps({**record, "files": files[0], "xxh3_128": files[1]}))
    return folder


@pytest.mark.unit
def test_pruning_keeps_the_newest_by_the_order_resume_uses(tmp_path: Path) -> None:
    """After a fallback: step 20 was abandoned (damaged, say, and then repaired by hand, or the run resumed from
    step 10 on purpose); the run saves 12 and 14 since. Keeping two keeps 14 and 12, the ones resume would take,
    not 20 and 14 (by step name)."""
    from launcher.checkpoint.format import complete, newest_intact
    from launcher.checkpoint.saving import _prune

    ck = tmp_path / "checkpoints"
    _made(ck, 10, 100.0), _made(ck, 20, 200.0), _made(ck, 12, 300.0), _made(ck, 14, 400.0)
    assert newest_intact(ck) == ck / "step_00000014"
    _prune(ck, keep_last=2)
    assert complete(ck) == [ck / "step_00000014", ck / "step_00000012"]
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000012", "step_00000014"]


@pytest.mark.unit
def test_room_is_asked_for_the_checkpoints_the_run_holds_at_once() -> None:
    from launcher.checkpoint.policy import SavePolicy

    def held_at_once(step: int, held: int, every: int = 2, at_end: bool = True, keep_last: int = 1) -> int:
        return SavePolicy(every, at_end, max_steps=10, keep_last=keep_last).held_at_once(step, held)

    assert held_at_once(0, 0) == 2  # keep_last + the one being written
    assert held_at_once(0, 1) == 1  # one already there: pruned once the next is complete
    assert held_at_once(0, 0, keep_last=0) == 5  # all kept: steps 2, 4, 6, 8, 10
    assert held_at_once(8, 0, keep_last=3) == 1  # from step 8: only step 10 is left to save
    assert held_at_once(0, 0, every=0, at_end=False) == 0
    assert held_at_once(0, 0, every=4, keep_last=0) == 3  # steps 4, 8 and the last, 10


RESUMED = [
    *TINY,
    "gpus=2",
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=2",
    "trainer.keep_last=0",
]


def test_a_run_resumes_from_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    """16 bytes flipped in the middle of a tensor file of the newest checkpoint (its size unchanged): the same
    command again skips it, saying which file and why, and resumes from the one before, exactly."""
    first = launch(tmp_path, *RESUMED).check()
    losses = first.losses()
    ck = first.run_dir / "checkpoints"
    newest, before = ck / "step_00000006", ck / "step_00000004"
    _flip(newest / "__0_0.distcp")
    line = (
        f"launch: error: checkpoint {newest} is damaged: __0_0.distcp fails its checksum (xxh3-128): its bytes "
        "changed after they were written; resume from another one"
    )
    assert launch_here(tmp_path, *RESUMED, f"resume={newest}", name="refused").refused() == line
    again = launch(tmp_path, *RESUMED).check()
    assert f"launch: skipping checkpoint {newest}: __0_0.distcp fails its checksum" in again.stdout, again.stdout
    assert f"resuming from {before} (step 4" in again.stdout, again.stdout
    assert [m["step"] for m in again.metrics][-2:] == [5, 6]  # appended to the first run's
    assert again.losses()[-2:] == pytest.approx(losses[4:6], abs=1e-6), (again.losses(), losses)


@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a small tmpfs of the given size under tmp_path (root can; skipped with the reason where it cannot, failed
    under LAUNCH_TEST_REQUIRE_ROOT=1)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if proc.returncode:
            unavailable(
                "LAUNCH_TEST_REQUIRE_ROOT",
                f"cannot mount a tmpfs here: {proc.stderr.decode().strip() or proc.returncode}",
            )
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(where: Path) -> None:
    with open(where / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass


def test_a_full_disk_at_start_is_one_line_and_leaves_no_run_directory(tmp_path: Path, tmpfs) -> None:
    disk = tmpfs(1 << 20)
    _fill(disk)
    run = launch(tmp_path, *TINY, "gpus=1", "trainer.max_steps=1", name=f"{disk.name}/new/run")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"launch: error: no space left on tmpfs at {disk} (0.0 MB free) while writing "), lines
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # new/ and new/run removed: the launch made them


@pytest.mark.unit
def test_a_refused_run_removes_only_the_folders_it_made(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    line = launch_here(tmp_path, *TINY, "gpus=2", "batch.global_size=30", name="x/run").refused()
    assert "batch.global_size=30" in line
    assert (tmp_path / "x").is_dir()  # it was there before the launch
    launch_here(tmp_path, *TINY, "gpus=2", "batch.global_size=30", name="y/z/run").refused()
    assert not (tmp_path / "y").exists()  # the launch made y/ and y/z/: gone with the run's folder


def _state_bytes(world_size: int) -> int:
    """What `launcher.checkpoint.space.checkpoint_bytes` counts for the TINY model (2 layers, 64 wide) under AdamW."""
    import torch
    from omegaconf import OmegaConf

    from launcher.checkpoint.space import checkpoint_bytes
    from launcher.config.optim_schema import AdamWConfig
    from launcher.models.gpt import GPT
    from launcher.optim.build import rules_for
    from launcher.optim.groups import param_groups

    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    rules = rules_for(OmegaConf.structured(AdamWConfig), torch.optim.AdamW)  # the launcher's groups: its entries too
    optim = torch.optim.AdamW(param_groups(model, rules, 1e-3))
    tokens = torch.zeros(1, 32, dtype=torch.long)
    model(tokens, tokens)["loss"].backward()
    optim.step()
    return checkpoint_bytes({"model": model.state_dict(), "optim": optim.state_dict()}, world_size)


def test_room_for_exactly_two_checkpoints_and_a_disk_that_fills_during_the_run(tmp_path: Path, tmpfs) -> None:
    """2 ranks under DDP, keep_last=1: at its fullest the run holds two checkpoints. With room for exactly two (and
    the run's logs) both are saved. Then another writer fills the disk at step 5: the save of step 6 is refused in
    one line for both ranks, naming the disk, the checkpoint and the one still intact."""
    size = _state_bytes(2)
    disk = tmpfs(2 * size + (512 << 10))
    filler = disk / "filler"
    run = launch(
        tmp_path,
        *TINY,
        "gpus=2",
        "batch.global_size=8",
        "batch.micro_size=2",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=2",
        "trainer.keep_last=1",
        "model._target_=faulty.DiskFillingGPT",
        f"+model.fill={filler}",
        "+model.leave=262144",
        "+model.bad_rank=0",
        "+model.at_call=9",
        name=f"{disk.name}/run",
    )
    ck = run.run_dir / "checkpoints"
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5, 6]
    assert lines[0].startswith(
        f"launch: error: ranks 0, 1 failed while saving the checkpoint of step 6: RuntimeError: no room on tmpfs at "
        f"{disk} ("
    ), lines
    assert f"for the checkpoint of step 6 (1 x {size / 1e6:,.1f} MB); the newest intact checkpoint is " in lines[0]
    assert f"{ck / 'step_00000004'}; free space there" in lines[0]
    assert [p.name for p in ck.glob("step_*")] == ["step_00000004"]


def test_no_room_at_start_for_the_checkpoints_a_run_holds_is_one_refusal(tmp_path: Path, tmpfs) -> None:
    """Room for one checkpoint of 2 ranks under DDP, where the run holds two at once (keep_last=1): the check before
    the first step refuses it once, naming the check, not as each rank's failure while building the model."""
    size = _state_bytes(2)
    disk = tmpfs(size + (512 << 10))
    run = launch(
        tmp_path,
        *TINY,
        "gpus=2",
        "batch.global_size=8",
        "batch.micro_size=2",
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "trainer.keep_last=1",
        name=f"{disk.name}/run",
    )
    (line,) = run.stderr.strip().splitlines()
    assert run.returncode == 1 and run.metrics == [], run.stderr
    assert line.startswith(f"launch: error: the check for room before the first save: no room on tmpfs at {disk} ("), (
        line
    )
    assert line.endswith(
        f"for the 2 checkpoint(s) this run holds at once (trainer.keep_last=1, 0 saved before) (2 x {size / 1e6:,.1f} "
        "MB); free space there, lower trainer.keep_last, or choose another hydra.run.dir"
    ), line


def test_a_failure_report_the_run_directory_cannot_hold_reaches_the_launcher(tmp_path: Path, tmpfs) -> None:
    """The worker's report goes where the elastic agent reads it, else to the launcher's spare folder, else to
    stderr; the launcher reads it from there, and ranks that failed alike are one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launcher.elastic.failures import rank_lines

    disk, spare = tmpfs(1 << 20), tmp_path / "spare"
    spare.mkdir()
    _fill(disk)
    report = "from pathlib import Path; from launcher.worker.lifecycle import report_failure; import sys; " + (
        "report_failure(OSError(28, 'No space left on device', sys.argv[2]), int(sys.argv[1]), Path(sys.argv[3]))"
    )
    errors = {}
    for rank in (0, 1):
        errors[rank] = disk / f"error{rank}.json"
        env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(errors[rank]), "LAUNCH_FAILURE_DIR": str(spare)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        args = [sys.executable, "-c", report, str(rank), str(disk / "metrics.jsonl"), str(disk)]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr  # told to the spare folder, not the terminal
        assert not errors[rank].exists()  # no half-written report for the agent to choke on
    failures = {r: ProcessFailure(local_rank=r, pid=1, exitcode=1, error_file=str(errors[r])) for r in (0, 1)}
    lines = rank_lines(ChildFailedError("launcher.worker.main", failures), 0, spare=spare)
    assert lines == [
        f"ranks 0, 1 failed while starting: OSError: no space left on tmpfs at {disk} (0.0 MB free) while writing "
        f"{disk / 'metrics.jsonl'}; free space there or choose another hydra.run.dir (traceback: (not written))"
    ], lines
    proc = subprocess.run(args, env={**env, "LAUNCH_FAILURE_DIR": str(disk)}, capture_output=True, text=True)
    assert proc.stderr.strip() == f"launch: error: rank 1 failed {lines[0].split(' failed ', 1)[1]}", proc.stderr


def _node(tmp_path: Path, port: int, name: str, *extra: str) -> subprocess.Popen[str]:
    """One node of a two-node job on loopback, one rank, in a session of its own (to be killed whole)."""
    overrides = [
        *TINY,
        "batch.global_size=8",
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=0",
        "trainer.save_at_end=false",
        "nodes=2",
        "gpus=1",
        f"rdzv.endpoint=127.0.0.1:{port}",
        f"rdzv.id={name}",
        f"hydra.run.dir={tmp_path / name}",
        *extra,
    ]
    return subprocess.Popen(
        [LAUNCH, *overrides],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


ELASTIC_STORE = pytest.param("the store's node of an elastic job", marks=pytest.mark.long)  # ~10 s, the same path


@pytest.mark.parametrize("lost", ["the other node", "the store's node", ELASTIC_STORE])
def test_a_lost_node_is_named_by_the_survivor(tmp_path: Path, lost: str) -> None:
    """Two one-rank nodes on loopback train together; one is killed whole (launcher and worker) mid-run. The
    survivor's one line names the node and rank that went away and its step, and what to do: where the rendezvous
    store lived on the node that vanished, that no job outlives it (an elastic one neither); never "did not join", no
    C++ frames."""
    import time

    port = free_port()
    name = {"the other node": "lost", "the store's node": "lost-store"}.get(lost, "lost-elastic")
    elastic = ["nodes=1:2", "trainer.max_restarts=2"] if "elastic" in lost else []
    host = _node(tmp_path, port, name, *elastic)  # binds the rendezvous store: the first on the endpoint
    until(lambda: listening(port), host, what="the rendezvous store")
    other = _node(tmp_path, port, name, *elastic)
    run_dir, killed = tmp_path / name, (other if lost == "the other node" else host)
    survivor = host if killed is other else other
    metrics = run_dir / "metrics.jsonl"
    for _ in range(3000):  # both have trained a few steps together
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        assert survivor.poll() is None and killed.poll() is None, (survivor.communicate(), killed.communicate())
        time.sleep(0.1)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate()
    out, err = survivor.communicate(timeout=300)
    records = {p.name: json.loads(p.read_text()) for p in (run_dir / "logs" / "ranks").glob("rank*.json")}
    gone = [
        int(n.removeprefix("rank").removesuffix(".json"))
        for n, r in records.items()
        if r["launcher"].split(":")[1] == str(killed.pid)
    ]
    lines = err.strip().splitlines()
    assert survivor.returncode == 1 and len(lines) == 1, err
    assert f"; rank {gone[0]}) went away at step " in lines[0] and lines[0].startswith("launch: error: node "), err
    assert "did not all join" not in err and "frame #" not in err + out, (out, err)
    if lost == "the other node":
        assert lines[0].endswith("(nodes=MIN:MAX with trainer.max_restarts=N)"), err  # how to make the job elastic
    else:  # the store went with the node: elastic or not, every node starts again
        said = f"; it hosted the rendezvous (rdzv.endpoint=127.0.0.1:{port}), whose store no job outlives"
        assert said + (", elastic or not:" if elastic else ":") in lines[0], err
        assert lines[0].endswith("with rdzv.endpoint on a node that is up, to resume from the last checkpoint"), err
        assert "make the job elastic" not in lines[0], err


STORE_HOST = """
import sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, multi_tenant=True, use_libuv=True)
sys.stdin.read()
"""
"""A rendezvous store on no node of the job (as an etcd or a head node's is): it outlives every node."""


def test_a_rank_hung_outside_a_collective_ends_with_the_job_it_stopped(tmp_path: Path) -> None:
    """Two one-rank nodes, the rendezvous store hosted apart; rank 1 hangs in its forward (not in a collective: no
    timeout of its own ends it). Rank 0 gives up waiting after trainer.collective_timeout and its node ends; rank 1's
    agent, whose store still answers and whose worker is alive, would keep its node for as long as the hang (an
    hour). It ends with the job, its one line the cause rank 0 reported, as every node's is."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdin=subprocess.PIPE)
    try:
        until(lambda: listening(port), store, what="the rendezvous store")  # type: ignore[arg-type]
        hang = [
            "model._target_=faulty.HangingGPT",
            "+model.bad_rank=1",
            "+model.at_call=3",
            "trainer.collective_timeout=10",
        ]
        nodes = [_node(tmp_path, port, "hung", *hang) for _ in range(2)]
        try:
            said = [node.communicate(timeout=600) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
    finally:
        store.kill()
    for node, (_, err) in zip(nodes, said):
        lines = err.strip().splitlines()
        assert node.returncode == 1 and len(lines) == 1, err
        assert "gave up; rank 1 never came to it" in lines[0] and lines[0].startswith("launch: error: rank 0 "), err
    assert any("this node's ranks stopped with it" in err for _, err in said), said  # rank 1's node
    assert "a rank of another node failed" in (tmp_path / "hung" / "logs" / "agent.log").read_text()


@pytest.mark.unit
def test_a_manifest_without_checksums_is_skipped_with_the_reason(tmp_path: Path) -> None:
    from launcher.checkpoint.format import newest_intact

    ck = tmp_path / "checkpoints"
    kept, old = _made(ck, 2, 100.0), _made(ck, 4, 200.0)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["xxh3_128"]  # as a launch before checksums wrote it
    (old / "manifest.json").write_text(json.dumps(manifest))
    said: list[str] = []
    assert newest_intact(ck, said.append) == kept
    why = "records no checksums: a launch before checksums wrote it"
    assert said == [f"launch: skipping checkpoint {old}: {old / 'manifest.json'} {why}"]


FULL_PROBE = r"""
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from launcher.checkpoint import saving
from launcher.checkpoint.format import Position

root, ck = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)

class State:
    def __init__(self, n):
        self.w = torch.ones(n)

    def state_dict(self):
        return {"model": {"w": self.w}}

saver = saving.Saver(ck, 0, 1, keep_last=0)
saver.save(Position(1, 8), State(1000), {"world_size": 1, "config_hash": "0" * 16})
saving.check_space = lambda *args: None  # another process takes the room after the check: the write meets ENOSPC
try:
    saver.save(Position(2, 16), State(1_000_000), {"world_size": 1, "config_hash": "0" * 16})
except RuntimeError as e:
    print("REFUSED", e)
dist.destroy_process_group()
"""


def test_a_disk_that_fills_during_a_write_is_one_line_and_keeps_the_intact_checkpoint(tmp_path: Path, tmpfs) -> None:
    """A real DCP write onto a tmpfs too small for it (the check before it bypassed, as when another process takes
    the room meanwhile): one line naming the disk, the checkpoint and the one still intact; the partial removed."""
    from launcher.checkpoint.format import damage

    disk = tmpfs(1 << 20)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", FULL_PROBE, str(tmp_path), str(disk / "ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    ck = disk / "ckpt"
    assert proc.stdout.startswith(f"REFUSED no space left on tmpfs at {disk} ("), (proc.stdout, proc.stderr)
    assert proc.stdout.strip().endswith(
        f"while writing the checkpoint of step 2 ({ck / '.step_00000002.partial'}, removed); the newest intact "
        f"checkpoint is {ck / 'step_00000001'}; free space there, lower trainer.keep_last, or choose another "
        "hydra.run.dir"
    ), proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001"] and damage(ck / "step_00000001") is None


@pytest.mark.unit
def test_ranks_that_failed_alike_are_named_in_rank_order_whichever_failed_first() -> None:
    from launcher.elastic.failures import _merged

    tail = "failed while saving: OSError: disk full (traceback: logs/rank{}.traceback)"
    lines = [f"rank {r} {tail.format(r)}" for r in (10, 1, 0)] + ["rank 2 failed: something else"]
    assert _merged(lines) == [f"ranks 0, 1, 10 {tail.format('<N>')}", "rank 2 failed: something else"]


@pytest.mark.unit
def test_a_node_whose_ranks_only_stopped_names_the_peer_rank_that_failed_first(tmp_path: Path) -> None:
    """Among many nodes, the one line a node whose ranks only lost their peers prints: the first cause another node's
    rank reported into the shared run directory, with its node; echoes, older files, damaged or crafted ones are not
    causes."""
    import time

    from launcher.elastic.failures import peer_failure

    logs = tmp_path / "logs"

    def report(agent: str, line: object, age: float = 0.0) -> None:
        file = logs / agent / "attempt_0" / "0" / "error.json"
        file.parent.mkdir(parents=True)
        file.write_text(json.dumps({"message": {"message": line}}))
        os.utime(file, (time.time() - age, time.time() - age))

    started = time.time() - 10
    assert peer_failure(tmp_path, started) is None  # nothing reported: a node that went away
    report("a", f"while in step 3: RuntimeError: Connection closed by peer (traceback: {logs}/rank1.traceback)")
    report("b", {"not": "a line"})
    report("c", "not json at all, no traceback")
    report("d", f"while in step 1: ValueError: old (traceback: {logs}/rank9.traceback)", age=3600)  # an earlier run
    (logs / "e" / "attempt_0" / "0").mkdir(parents=True)
    (logs / "e" / "attempt_0" / "0" / "error.json").write_bytes(b"\xff\xfe{")
    assert peer_failure(tmp_path, started) is None
    report("f", f"while in forward/backward of step 1: RuntimeError: broke (traceback: {logs}/rank20.traceback)", 2)
    report("g", f"while in step 1: RuntimeError: later (traceback: {logs}/rank7.traceback)", age=1)
    (logs / "ranks").mkdir()
    (logs / "ranks" / "rank20.json").write_text(json.dumps({"node": 20, "host": "gpu20", "launcher": "x"}))
    assert peer_failure(tmp_path, started) == (
        f"rank 20 (node 20, gpu20) failed while in forward/backward of step 1: RuntimeError: broke (traceback: "
        f"{logs}/rank20.traceback); this node's ranks stopped with it"
    )
    # Whether this node's own rank had joined: a lost rendezvous is then no join that timed out.
    from launcher.elastic.failures import joined_here

    assert not joined_here(tmp_path, started, "me")
    (logs / "ranks" / "rank3.json").write_text(json.dumps({"node": 3, "host": "n3", "launcher": "me"}))
    (logs / "ranks" / "rank4.json").write_bytes(b"\xff[")
    assert joined_here(tmp_path, started, "me") and not joined_here(tmp_path, time.time() + 60, "me")
    # A refusal every rank made alike (a node whose run directory is its own), earliest: its own words, once.
    refusal = "rank 20 (on n20) does not see /runs/a as rank 0 wrote it: the nodes of one run need one shared run"
    report("h", f"refused: {refusal}", age=3)
    assert peer_failure(tmp_path, started) == refusal


def test_a_cause_on_file_after_the_node_heard_of_the_failure_is_named_not_a_node_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node can hear that its peers are gone before the failed rank's report shows in the shared run directory (the
    race that once named the wrong node among 16): it asks again while the report is not there, and names the cause
    once it shows; with none, it gives up after its wait (a node that went away reports nothing)."""
    import time

    from launcher.elastic import failures

    logs = tmp_path / "logs"
    started, asked = time.time() - 10, []

    def late_report(seconds: float) -> None:  # the report lands while the node waits
        asked.append(seconds)
        if len(asked) == 2:
            file = logs / "b" / "attempt_0" / "0" / "error.json"
            file.parent.mkdir(parents=True)
            line = f"while in step 4: RuntimeError: broke (traceback: {logs}/rank10.traceback)"
            file.write_text(json.dumps({"message": {"message": line}}))

    monkeypatch.setattr(failures.time, "sleep", late_report)
    cause = failures.awaited_cause(tmp_path, started, wait_s=3600)
    assert len(asked) == 2 and cause is not None and cause.startswith("rank 10 failed while in step 4"), cause
    assert failures.awaited_cause(tmp_path / "none", started, wait_s=0) is None


def test_free_space_is_checked_before_a_save(tmp_path: Path) -> None:
    """A real save on a one-rank gloo group; only the free-space reading is made small (a full disk cannot be
    made here without privileges)."""
    probe = f"""
import shutil, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from launcher.checkpoint.format import Position
from launcher.checkpoint.saving import Saver
dist.init_process_group("gloo", init_method="file://{tmp_path / "pg"}", rank=0, world_size=1)
class Tiny:
    def state_dict(self):
        return {{"model": {{"w": torch.zeros(1_000_000)}}}}
real = shutil.disk_usage
shutil.disk_usage = lambda path: real(path)._replace(free=1_000_000)
try:
    Saver(Path({str(tmp_path / "ckpt")!r}), 0, 1, 0).save(Position(1, 8), Tiny(), {{}})
except RuntimeError as e:
    print("REFUSED", e)
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in proc.stdout, proc.stderr
    assert "(1.0 MB free) for the checkpoint of step 1 (1 x 4.0 MB); no checkpoint was saved" in proc.stdout, (
        proc.stdout
    )
    assert not list((tmp_path / "ckpt").glob("step_*"))  # nothing visible


def test_a_stopped_process_is_told_from_a_running_one() -> None:
    """What the launcher reads before it gives a worker of a failed group time to answer SIGTERM: a stopped process
    (SIGSTOP, a debugger) never can, and is killed at once."""
    import signal
    import time

    from launcher.elastic.agent import _stopped

    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not _stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):  # the kernel marks it stopped once the signal is delivered
            if _stopped(proc.pid):
                break
            time.sleep(0.01)
        assert _stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        for _ in range(100):
            if not _stopped(proc.pid):
                break
            time.sleep(0.01)
        assert not _stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not _stopped(proc.pid)  # gone: nothing to wait for either


def test_a_worker_s_exit_is_read_without_reaping_it() -> None:
    """The agent looks at a worker's exit before torch's poll does, to stop the others itself: it reads the code (a
    signal's as its negative) and leaves the process to be reaped by whoever started it (torch), who then reads the
    same code."""
    import time

    from launcher.elastic.agent import _exit_code, _running

    failed = subprocess.Popen(["sh", "-c", "exit 3"])
    running = subprocess.Popen(["sleep", "60"])
    try:
        while _exit_code(failed.pid) is None:  # until it has ended
            time.sleep(0.01)
        assert _exit_code(failed.pid) == 3 and not _running(failed.pid)
        assert failed.wait() == 3  # still there to be reaped, with its code
        assert _exit_code(failed.pid) is None and not _running(failed.pid)  # reaped: no child of this process now
        assert _running(running.pid) and _exit_code(running.pid) is None
        running.send_signal(signal.SIGSTOP)  # stopped is not ended
        assert _running(running.pid) and _exit_code(running.pid) is None
        running.kill()
        while _exit_code(running.pid) is None:
            time.sleep(0.01)
        assert _exit_code(running.pid) == -signal.SIGKILL and running.wait() == -signal.SIGKILL
    finally:
        running.kill()
        running.wait()


@pytest.mark.unit
def test_a_killed_launchers_empty_failure_folder_is_removed_by_the_next_and_nothing_else() -> None:
    """A launcher killed by SIGKILL leaves its (empty) failure folder in /dev/shm; the next launcher on the machine
    removes it. A dead launcher's folder holding a report, and a running launcher's, stay."""
    from launcher.parent.workers import failure_folder

    dead = subprocess.Popen(["true"])
    dead.wait()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(__import__("tempfile").gettempdir())
    empty, report, running = (
        shm / f"launch-failures-{pid}-{tag}"
        for pid, tag in ((dead.pid, "test0"), (dead.pid, "test1"), (os.getpid(), "test2"))
    )
    for folder in (empty, report, running):
        folder.mkdir()
    (report / "rank0.json").write_text("{}")
    mine = report
    try:
        mine = failure_folder()
        assert mine.name.startswith(f"launch-failures-{os.getpid()}-") and mine.is_dir()
        assert not empty.exists() and report.exists() and running.exists()
    finally:
        for folder in (report, running, mine):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.unit
def test_a_failure_is_told_by_its_cause_and_its_echoes_without_the_collective_library_s_words(tmp_path: Path) -> None:
    """Rank 0's own error first; rank 1, which only lost its peer, is an echo: told (if at all) without gloo's text.
    A refusal every rank made alike is one line with no rank in it."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launcher.elastic.failures import rank_lines, secondary

    def failed(reports: dict[int, str]) -> ChildFailedError:
        failures = {}
        for rank, line in reports.items():
            file = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
            info = {"py_callstack": "", "timestamp": str(int(time.time())), "time": time.time() + rank}
            file.write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
            failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(file))
        return ChildFailedError("launcher.worker.main", failures)

    cause = (
        "while saving the checkpoint of step 4: EndpointConnectionError: Could not connect to the endpoint URL: "
        '"http://127.0.0.1:1/b/x" (traceback: logs/rank0.traceback)'
    )
    echo = (
        "while saving the checkpoint of step 4: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534]"
        " Connection closed by peer [127.0.0.1]:5 This is typically caused by a remote worker crashing. GLHF! "
        "(traceback: logs/rank1.traceback)"
    )
    lines = rank_lines(failed({1: echo, 0: cause}), 0)
    assert lines == [
        f"rank 0 failed {cause}",
        "rank 1 lost its peers while saving the checkpoint of step 4 (another rank ended first)",
    ], lines
    assert not secondary(lines[0]) and secondary(lines[1]) and "gloo" not in lines[1].lower()
    refusal = "refused: the check for room before the first save: no room on tmpfs at /x for the checkpoint"
    lines = rank_lines(failed({0: refusal, 1: refusal}), 0)
    assert lines == [refusal.removeprefix("refused: ")], lines


@pytest.mark.long  # ~20 s: a fault's cause and its echoes are told apart in process above
def test_an_object_store_that_goes_away_mid_run_is_told_by_its_cause(tmp_path: Path) -> None:
    """Checkpoints every step into an S3 store (moto's server, in a process of its own), which is killed once a save
    is complete: the job ends with the store's own error as its cause (rank 0's, or each rank's that met it), never
    the collective library's words for a peer that ended first."""
    import time

    from object_store import BUCKET, SECRET

    port = free_port()
    env = clean_env(tmp_path) | {
        "AWS_ACCESS_KEY_ID": "launch-test",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    store = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(lambda: listening(port), store, what="the S3 server")  # type: ignore[arg-type]
        import s3fs

        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            key="launch-test",
            secret=SECRET,
            endpoint_url=f"http://127.0.0.1:{port}",
        )
        fs.mkdir(BUCKET)
        job = [
            *(o for o in TINY if not o.startswith("model.n_embd")),
            "model.n_embd=256",
            "batch.global_size=16",
            "batch.micro_size=4",
            "gpus=2",
            "trainer.max_steps=40",
            "trainer.checkpoint_every=1",
            "trainer.keep_last=2",
            f"trainer.checkpoint_dir=s3://{BUCKET}/gone",
        ]
        run_dir = tmp_path / "run"
        proc = subprocess.Popen(
            [LAUNCH, *job, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while proc.poll() is None and not fs.exists(f"{BUCKET}/gone/latest"):  # a save complete: the store works
            time.sleep(0.05)
            fs.invalidate_cache()
        store.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        store.kill()
        store.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and 1 <= len(lines) <= 2, err
    assert all(line.startswith("launch: error: rank") and "EndpointConnectionError" in line for line in lines), err
    assert lines[0].startswith("launch: error: rank 0 ") or "ranks 0, 1" in lines[0], err
    for words in ("gloo", "GLHF", "Connection closed by peer", "lost its peers", "Traceback"):
        assert words not in err, err
