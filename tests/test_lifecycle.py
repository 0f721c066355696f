"""Preemption and process hygiene: graceful stops, no orphans, restarts that always recover, hangs that end."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    LAUNCH,
    TINY,
    Run,
    assert_each_restart_resumes_the_newest,
    clean_env,
    launch,
    launch_here,
    launch_once,
)
from processes import free_port, tcp_addresses, wait_for_step, worker_pids

JOB = [
    *TINY,
    "data=pysource",
    "gpus=2",
    "batch.global_size=16",
    "batch.micro_size=4",
    "optim.lr=3e-3",
    "trainer.max_steps=30",
    "trainer.warmup_steps=4",
]


def _start(tmp_path: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [LAUNCH, *JOB, *extra, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env or clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture
def reference(conformance_dir: Path) -> Run:
    """The uninterrupted 30-step run, made once per session whichever test process asks first; steps 3 and 4 are
    profiled (which changes no loss)."""
    return launch_once(
        conformance_dir, *JOB, f"trainer.profile_steps=[{PROFILED[0]},{PROFILED[1]}]", name="lifecycle-reference"
    ).check()


PROFILED = (3, 4)


def test_the_profiler_traces_exactly_the_chosen_steps_on_every_rank(reference: Run) -> None:
    for rank in (0, 1):
        trace = json.loads((reference.run_dir / "profile" / f"rank{rank}.json").read_text())  # Chrome/Perfetto JSON
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        steps = {e["name"]: e for e in events if e["name"].startswith("launch/step ")}
        assert sorted(steps) == [f"launch/step {s}" for s in PROFILED], sorted(steps)
        for step in steps.values():  # the model's own ops ran inside each profiled step, with their shapes
            inside = [e for e in events if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
            ops = {e["name"] for e in inside}
            assert {"aten::embedding", "aten::layer_norm", "aten::mm"} <= ops, sorted(ops)[:40]
            assert any("Input Dims" in e.get("args", {}) for e in inside)
    assert f"launch: profile of steps {PROFILED[0]}-{PROFILED[1]}" in reference.stdout, reference.stdout
    assert "Self CPU" in reference.stdout and "aten::" in reference.stdout  # rank 0's top ops
    assert "PythonDispatchMode" not in reference.stdout  # the logged steps' memory probe stays out of the profile


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGUSR2, marks=pytest.mark.long)])  # SLURM's
# warning: its graceful stop is the same path, ~15 s more; the long tier
def test_a_signal_stops_gracefully_and_resume_continues_exactly(
    sig: signal.Signals, reference: Run, tmp_path: Path
) -> None:
    runs = tmp_path / "outputs"
    runs.mkdir()
    # SIGUSR2 with asynchronous checkpoints: the stop waits for the background write, then says where it is.
    proc = _start(runs, runs / "stopped", *(["trainer.async_checkpoint=true"] if sig == signal.SIGUSR2 else []))
    wait_for_step(runs / "stopped", 5, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert f"launch: stopped by {sig.name}: checkpoint" in err and "resume=" in err, err
    stopped_at = max(_losses(runs / "stopped"))
    assert 5 <= stopped_at < 30 and (runs / "stopped" / "checkpoints" / f"step_{stopped_at:08d}").is_dir()
    assert worker_pids(runs / "stopped") == {}
    # SIGTERM: resume=auto finds it; SIGUSR2: the command the stop message suggests, resume=<run dir>.
    suggested = re.search(r"plus (resume=\S+)", err).group(1)
    assert suggested == f"resume={runs / 'stopped'}", err
    resumed = launch(runs, *JOB, "resume=auto" if sig == signal.SIGTERM else suggested, name="resumed").check()
    assert f"resuming from {runs / 'stopped' / 'checkpoints' / f'step_{stopped_at:08d}'}" in resumed.stdout
    assert resumed.metrics[0]["step"] == stopped_at + 1
    full = {m["step"]: m["loss"] for m in reference.metrics}
    assert max(abs(full[m["step"]] - m["loss"]) for m in resumed.metrics) <= 1e-6


@pytest.mark.parametrize("when", ["at start", "while training"])
def test_killing_the_launcher_leaves_no_worker_behind(tmp_path: Path, when: str) -> None:
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, run_dir, "trainer.max_steps=400")
    if when == "at start":  # before the workers have joined: the parent-death signal ends them
        while len(worker_pids(run_dir)) < 2 and proc.poll() is None:
            time.sleep(0.01)
    else:
        wait_for_step(run_dir, 3, proc)
        workers = worker_pids(run_dir)
        assert len(workers) == 2
        # One node: the process group's sockets and every connection on loopback, never on an external interface.
        # (The TCPStore servers, the agent's and rank 0's, listen on every interface: torch takes no address for them
        # to bind. Forked workers hold the agent's too, inherited, and never accept on it.)
        launcher_args = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert all(Path(f"/proc/{pid}/cmdline").read_bytes() == launcher_args for pid in workers.values())  # forked
        inherited = tcp_addresses(proc.pid)
        for rank, pid in workers.items():
            own = [a for inode, a in tcp_addresses(pid).items() if inode not in inherited]
            stores = [address for address, listening in own if listening and address == "::"]
            assert len(stores) == (rank == 0), (rank, own)
            assert own and all(ipaddress.ip_address(a).is_loopback for a, _ in own if a != "::"), (rank, own)
        # The run owns its directory while it runs: a second launch there is refused, and writes nothing.
        second = launch_here(tmp_path, *JOB, "trainer.max_steps=400", name="run")
        assert second.returncode == 2 and "is in use by another launch (pid" in second.stderr, second.stderr
        assert worker_pids(run_dir).keys() == workers.keys()
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 5
    while worker_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pids(run_dir) == {}


def test_fresh_workers_train_exactly_as_forked_ones(reference: Run, tmp_path: Path) -> None:
    """CPU workers are forked from the launcher unless trainer.fork_workers=false; started afresh (as on CUDA, where
    they always are), every logged figure of the run is the same to the last bit."""
    fresh = launch(tmp_path, *JOB, "trainer.fork_workers=false").check()
    assert fresh.losses() == reference.losses() and len(fresh.losses()) == 30
    assert [m.get("val_loss") for m in fresh.metrics] == [m.get("val_loss") for m in reference.metrics]


@pytest.mark.long  # ~20 s: a killed worker restarted to the same losses is test_checkpoint's
def test_every_restart_recovers(reference: Run, tmp_path: Path) -> None:
    """Six kills in one run: a 40% chance of a failed restart would slip through 0.6^6 = 5% of the time."""
    kills, run_dir = 6, tmp_path / "run"
    proc = _start(tmp_path, run_dir, "trainer.checkpoint_every=2", f"trainer.max_restarts={kills}")
    for n in range(kills):
        wait_for_step(run_dir, 4 * n + 3, proc)
        pids = worker_pids(run_dir)
        os.kill(pids[n % 2], signal.SIGKILL)
        while worker_pids(run_dir).get(n % 2) == pids[n % 2]:
            time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert all(f"restart {n} of the worker group: resuming from" in out for n in range(1, kills + 1)), out
    assert_each_restart_resumes_the_newest(run_dir, out, every=2, restarts=kills)
    final = _losses(run_dir)
    assert abs(final[30] - reference.metrics[-1]["loss"]) <= 1e-6


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in (found := path.read_text()):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{path} never said {text!r}")


def test_a_hang_names_the_stuck_rank_and_sigusr1_shows_every_rank_s_stack(tmp_path: Path) -> None:
    """Rank 1 sleeps in its forward; rank 0 waits in the gradient all-reduce. While they hang, SIGUSR1 to the
    launcher makes every rank write its phase and its Python stacks (rank 1's in the model's sleep, rank 0's in the
    collective); then rank 1 is stopped (SIGSTOP: it can act on no signal), and the timeout ends the job in one line
    naming the stuck rank. The stuck rank is killed at once, not given torch's 30 s to answer a SIGTERM it cannot."""
    run_dir = tmp_path / "hang"
    proc = _start(tmp_path, run_dir, "model._target_=faulty.HangingGPT", "trainer.collective_timeout=10")
    stuck = "in forward/backward of step 2, micro-step 1/2"
    _wait_for(run_dir / "logs" / "phase" / "rank1", stuck, proc)  # written by its thread within seconds
    proc.send_signal(signal.SIGUSR1)
    stacks = _wait_for(run_dir / "logs" / "stacks" / "rank1", "in fail", proc)
    assert "faulty.py" in stacks and "train_step" in stacks, stacks
    assert "train_step" in _wait_for(run_dir / "logs" / "stacks" / "rank0", "train_step", proc)
    rank1 = worker_pids(run_dir)[1]
    os.kill(rank1, signal.SIGSTOP)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, (proc.returncode, err)
    (line,) = err.strip().splitlines()  # the cause; the stopped rank's end is no failure of its own
    assert "rank 0 waited 10 s in a collective" in line and "rank 1 never came to it: rank 1 (on " in line, err
    assert f") was last {stuck}" in line, err
    agent = (run_dir / "logs" / "agent.log").read_text()
    assert f"launch: killing rank 1 (pid {rank1}) at once: a rank gave up waiting for it in a collective" in agent
    assert "Unable to shutdown process" not in agent, agent  # torch's SIGKILL, after 30 s of waiting on SIGTERM
    assert worker_pids(run_dir) == {}


@pytest.mark.unit
def test_the_phase_is_kept_in_memory_and_written_now_and_then(tmp_path: Path) -> None:
    """A phase a micro-step costs no I/O: 20,000 phases between two of the writer's rounds are not written (at most
    the first phase, by the writer's first round); a flush writes the newest, with the time it began."""
    from launcher.worker.lifecycle import Phase

    phase = Phase(tmp_path, 0, every=3600.0)
    for n in range(20_000):
        phase(f"in forward/backward of step {n}")
    assert phase.writes <= 1, phase.writes
    phase("saving the checkpoint of step 7")
    began = phase.state[0]
    phase.flush()
    stamp, _, what = (tmp_path / "logs" / "phase" / "rank0").read_text().partition(" ")
    assert what == "saving the checkpoint of step 7" and float(stamp) == pytest.approx(began, abs=1e-3)
    assert phase.writes <= 2, phase.writes
    # From a signal handler: one that interrupts a write of its own thread neither waits nor raises (a second
    # SIGTERM within milliseconds once killed a rank mid-save here), nor does a folder that is gone.
    phase("stopping")
    written = phase.writes
    with phase._lock:  # the writer busy: try_flush returns at once, leaving the phase to the writer's next round
        attempt = threading.Thread(target=phase.try_flush, daemon=True)
        attempt.start()
        attempt.join(60)  # a try_flush that waits for the lock never returns while it is held here
        assert not attempt.is_alive() and phase.writes == written, phase.writes
    phase.try_flush()
    assert phase.writes == written + 1 and (tmp_path / "logs" / "phase" / "rank0").read_text().endswith(" stopping")
    shutil.rmtree(tmp_path / "logs")
    phase("gone")
    phase.try_flush()  # the folder is gone: nothing raised, nothing made
    assert phase.writes == written + 1 and not (tmp_path / "logs").exists()


@pytest.mark.unit
def test_nodes_of_one_job_that_claim_the_run_directory_at_once_all_get_it(tmp_path: Path) -> None:
    """Another node of the job holds the directory's lock for the moment it writes the claim: this node waits for it
    rather than refusing (at 2 to 32 nodes on loopback one node of a job was refused this way); a launch on one node
    holding the lock is still refused at once."""
    import fcntl

    from launcher.config import ConfigError
    from launcher.parent.rundir import CLAIM, LOCK, claim

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = open(run_dir / LOCK, "a")  # another node's launcher: its own open file, its own lock
    fcntl.flock(other, fcntl.LOCK_EX)
    threading.Timer(0.5, lambda: fcntl.flock(other, fcntl.LOCK_UN)).start()
    ownership = claim(run_dir, "h", job="job7")
    assert ownership.lock is None and json.loads((run_dir / CLAIM).read_text())["job"] == "job7"
    fcntl.flock(other, fcntl.LOCK_EX)  # a launch of the same run on one node, running
    with pytest.raises(ConfigError, match="is in use by another launch"):
        claim(run_dir, "h", job=None)
    other.close()


@pytest.mark.unit
def test_a_rank_that_gives_up_names_the_ranks_that_never_came_to_the_collective(tmp_path: Path) -> None:
    """Among many ranks every one is in the same phase while one is stuck (a gradient all-reduce runs inside the
    backward): the ranks at fault are those whose phase does not say they gave up too; an earlier attempt's file
    says nothing of this one."""
    from launcher.base.run_files import WAITING
    from launcher.worker.lifecycle import Phase

    (tmp_path / "logs" / "phase").mkdir(parents=True)
    stale = tmp_path / "logs" / "phase" / "rank4"
    stale.write_text(f"1.000 {WAITING} while in forward/backward of step 9")
    os.utime(stale, (1.0, 1.0))  # written by an earlier worker group
    # Rank 0's writer at its usual pace (what it takes as the others' pace too); the others' writers write when told.
    phases = [Phase(tmp_path, rank, every=2.0 if rank == 0 else 3600.0) for rank in range(4)]  # rank 4: not yet
    step = "in forward/backward of step 3, micro-step 1/1"
    for rank in range(4):
        phases[rank](step)
    for rank in (1, 3):
        phases[rank](f"{WAITING} while {step}")
    for rank in range(1, 4):
        phases[rank].flush()
    (tmp_path / "logs" / "ranks").mkdir()
    (tmp_path / "logs" / "ranks" / "rank2.json").write_text(json.dumps({"node": 2, "host": "n2", "launcher": "x"}))
    line = phases[0].gave_up(5, wait=0.5)
    assert line.startswith(f"ranks 2, 4 never came to it: rank 4 wrote no report; rank 2 (on n2) was last {step} ")
    assert line.endswith("; 2 other ranks gave up waiting too"), line
    assert WAITING in (tmp_path / "logs" / "phase" / "rank0").read_text()  # its own mark, for the others
    phases.append(Phase(tmp_path, 4, every=3600.0))
    phases[4](f"{WAITING} while {step}")
    phases[4].flush()
    # Rank 2 stopped (SIGSTOP, a debugger): its writer no longer touches its file, so no mark of its can come; the
    # rank that gave up does not wait the whole 600 s for it (the test's timeout would end it first).
    phases[0].born -= 120  # the group started two minutes ago, rank 2 was last heard from one minute ago
    os.utime(tmp_path / "logs" / "phase" / "rank2", (time.time() - 60, time.time() - 60))
    line = phases[0].gave_up(5, wait=600.0)
    assert line.startswith(f"rank 2 never came to it: rank 2 (on n2) was last {step} "), line
    assert "is 60 s old); 3 other ranks gave up waiting too" in line, line
    phases[2](f"{WAITING} while {step}")
    phases[2].flush()
    assert phases[0].gave_up(5, wait=600.0).startswith("every other rank gave up waiting too: none is stuck")


def test_an_out_of_memory_error_says_how_to_see_where_the_memory_went(tmp_path: Path) -> None:
    """The path around torch.cuda.OutOfMemoryError, on CPU: one line per rank, the snapshot's advice, no hang."""
    run = launch(tmp_path, *JOB, "model._target_=faulty.OutOfMemoryGPT", "trainer.collective_timeout=30")
    assert run.returncode == 1, run.stderr
    line = next(x for x in run.stderr.splitlines() if x.startswith("launch: error: rank 1 failed"))
    assert "while in forward/backward of step 2, micro-step 1/2" in line, line
    assert "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in line, line
    assert "rerun with trainer.memory_snapshot=true" in line and "pytorch.org/memory_viz" in line, line
    assert worker_pids(run.run_dir) == {}


@pytest.mark.unit
def test_nccl_s_flight_recorder_is_on_unless_the_user_chose(tmp_path: Path) -> None:
    """What the launcher puts in a CUDA run's worker environment (there is no GPU here: the function it calls)."""
    from launcher.base.run_files import flight_recorder_env

    folder = tmp_path / "logs" / "flight_recorder"
    assert flight_recorder_env(tmp_path, {}) == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/rank_",
    }
    chosen = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}  # the older name counts too
    assert flight_recorder_env(tmp_path, chosen) == {"TORCH_FR_DUMP_TEMP_FILE": f"{folder}/rank_"}


@pytest.mark.long  # ~15 s: a requeue under a real SLURM is test_slurm's (long too); resume=auto is test_checkpoint's
def test_a_requeued_slurm_job_resumes_by_itself(reference: Run, tmp_path: Path) -> None:
    """What SLURM does on preemption: SIGTERM to the job, then the same job again with SLURM_RESTART_COUNT + 1."""
    run_dir, port = tmp_path / "job", free_port()
    slurm = {
        "SLURM_JOB_ID": "31337",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NTASKS_PER_NODE": "1",
    }
    first = _start(
        tmp_path, run_dir, f"rdzv.port={port}", env=clean_env(tmp_path) | slurm | {"SLURM_RESTART_COUNT": "0"}
    )
    wait_for_step(run_dir, 5, first)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    again = _start(
        tmp_path, run_dir, f"rdzv.port={port}", env=clean_env(tmp_path) | slurm | {"SLURM_RESTART_COUNT": "1"}
    )
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"resuming from {run_dir / 'checkpoints'}" in out, out
    assert abs(_losses(run_dir)[30] - reference.metrics[-1]["loss"]) <= 1e-6


@pytest.mark.long  # ~20 s: a signal's graceful stop and exact resume are the signal test's
def test_slurm_style_signals_during_a_long_save_end_with_a_complete_checkpoint(tmp_path: Path) -> None:
    """slurmstepd signals every process of a step at once (the launcher and each worker), and the elastic agent
    forwards the signal to the workers again: all of it while a save of a few seconds is being written. The run
    finishes that save and stops with a complete checkpoint; repeats within seconds are not a second request."""
    from launcher.checkpoint.format import is_complete, latest

    run_dir = tmp_path / "run"
    big = [
        "model.n_embd=512",
        "model.n_head=8",
        "model.n_layer=12",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=1",
    ]
    proc = _start(tmp_path, run_dir, *big, "trainer.max_steps=100")
    while not (partial := next((run_dir / "checkpoints").glob(".step_*.partial"), None)):  # a hang: pytest's timeout
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    saving = int(partial.name.removeprefix(".step_").removesuffix(".partial"))
    for pid in [proc.pid, *worker_pids(run_dir).values()]:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    newest = latest(run_dir / "checkpoints")
    assert newest is not None and is_complete(newest) and int(newest.name.removeprefix("step_")) >= saving, newest
    assert f"launch: stopped by SIGTERM: checkpoint {newest}" in err, err
    assert not list((run_dir / "checkpoints").glob(".step_*.partial"))
    loads = subprocess.run([LAUNCH, "convert", str(newest), f"out={tmp_path / 'w.safetensors'}"], capture_output=True)
    assert loads.returncode == 0, loads.stderr  # every tensor of it reads back


def test_only_a_repeat_well_after_the_first_stops_at_once(tmp_path: Path) -> None:
    probe = """
import os, signal, sys, time
from launcher.worker import lifecycle
lifecycle.STOP_REPEAT_GRACE = 1.0
stop = lifecycle.StopRequest().install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the agent's forwarded copy, within the grace
time.sleep(0.1)
print("still saving after two signals:", stop.signal == signal.SIGTERM, flush=True)
time.sleep(1.5)
os.kill(os.getpid(), signal.SIGTERM)  # asked again, well after: exit now
time.sleep(5)
print("never reached", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "still saving after two signals: True" in proc.stdout and "never reached" not in proc.stdout, proc
    assert proc.returncode == 128 + signal.SIGTERM
