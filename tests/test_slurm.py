"""SLURM for real: jobs submitted to a controller and two nodes running on this machine (`slurm_cluster.Cluster`),
through Hydra's submitit_slurm launcher and through a plain sbatch script that calls `srun launch`; each node's
launcher has one CPU rank, and the two nodes log one process's losses.

Marked `long`: the cluster starts in about a second, but each job is two launchers and their workers, 20-60 s on two
busy cores; the cheaper tests in test_cluster.py cover the same code with SLURM's variables set by hand."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch_once, unavailable
from processes import run_processes
from slurm_cluster import Cluster, missing

pytestmark = pytest.mark.long
JOB = [*TINY, "batch.global_size=16", "trainer.max_steps=5"]
TWO_NODES = ["nodes=2", "gpus=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module's tests, stopped by pid at its end, whatever they did."""
    if why := missing():
        unavailable("LAUNCH_TEST_REQUIRE_SLURM", why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def slurm(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with no job left on it after the test (a failed test's jobs are cancelled and waited for)."""
    yield cluster
    cluster.clear()


def _env(cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path) | {"SLURM_CONF": str(cluster.conf)}


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _one_process(conformance_dir: Path) -> list[float]:
    return launch_once(conformance_dir, *JOB, "gpus=1", name="slurm-one-process").check().losses()


def _exact(run_dir: Path, conformance_dir: Path) -> None:
    two, one = list(_losses(run_dir).values()), _one_process(conformance_dir)
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-6, (one, two)


def _sbatch(cluster: Cluster, tmp_path: Path, script: str, *options: str, wait: bool = True, ok: bool = True) -> str:
    """Submit `script` (its #SBATCH lines, then its commands) from tmp_path; the job's id. With `wait`, sbatch
    returns once the job has ended, non-zero where it failed."""
    path = tmp_path / "job.sh"
    path.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/slurm-%j.out\n#SBATCH --open-mode=append\n{script}\n")
    argv = ["sbatch", "--parsable", *(["--wait"] if wait else []), *options, str(path)]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(cluster, tmp_path), capture_output=True, text=True, timeout=600)
    output = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert (proc.returncode == 0) == ok, (proc.stdout, proc.stderr, output)
    return proc.stdout.strip().split(";")[0]


def test_submitit_slurm_runs_on_both_nodes_as_one_process(
    slurm: Cluster, conformance_dir: Path, tmp_path: Path
) -> None:
    """`launch -m hydra/launcher=submitit_slurm nodes=2`: submitted with sbatch, one launcher on n1 and one on n2,
    meeting at n1's NodeAddr (n1 itself does not resolve here)."""
    sweep = tmp_path / "sweep"
    argv = [LAUNCH, "-m", "hydra/launcher=submitit_slurm", *JOB, *TWO_NODES, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(slurm, tmp_path), capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*.out"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr, logs)
    assert "via rendezvous 127.0.0.1:" in logs and ", node 1 of a slurm job" in logs, logs
    _exact(sweep / "0", conformance_dir)


def test_an_sbatch_script_that_calls_srun_launch(slurm: Cluster, conformance_dir: Path, tmp_path: Path) -> None:
    """The form of docs/clusters.md: `srun launch ...` in a batch script of two nodes, one task each."""
    run_dir = tmp_path / "run"
    job = _sbatch(
        slurm,
        tmp_path,
        f"#SBATCH --nodes=2 --ntasks-per-node=1\nsrun {LAUNCH} {' '.join(JOB + TWO_NODES)} hydra.run.dir={run_dir}",
    )
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert "node 0 of a slurm job" in output and "node 1 of a slurm job" in output, output
    _exact(run_dir, conformance_dir)
    assert not run_processes(run_dir)


# Slow enough to act between steps while `slow` exists (faulty.SlowGPT: the built-in GPT with a sleep, same losses).
STEPS = 10
LONGER = [*JOB[:-1], f"trainer.max_steps={STEPS}"]


def _slow(slow: Path) -> list[str]:
    return [
        "model._target_=faulty.SlowGPT",
        "+model.sleep_s=0.5",
        "+model.slow_rank=null",
        f"+model.while_there={slow}",
    ]


def _reference(conformance_dir: Path) -> dict[int, float]:
    run = launch_once(conformance_dir, *LONGER, "gpus=1", name="slurm-one-process-longer").check()
    return {m["step"]: m["loss"] for m in run.metrics}


def _wait_for_step(cluster: Cluster, run_dir: Path, step: int, timeout: float = 600) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(_losses(run_dir), default=0) >= step:
            return
        assert cluster.jobs(), "the job ended before step {step}"
        time.sleep(0.2)
    raise AssertionError(f"the job never reached step {step}")


def _slow_job(cluster: Cluster, tmp_path: Path, run_dir: Path, *overrides: str, nodes: int = 2) -> str:
    """A job running slowly (until tmp_path/slow is removed), once it has logged step 2: `srun launch` on two nodes,
    or `exec launch` in the batch script of one."""
    slow = tmp_path / "slow"
    slow.touch()
    shape = TWO_NODES if nodes == 2 else ["gpus=1"]
    command = " ".join([LAUNCH, *LONGER, *_slow(slow), *shape, *overrides, f"hydra.run.dir={run_dir}"])
    start = f"srun {command}" if nodes > 1 else f"exec {command}"
    job = _sbatch(cluster, tmp_path, f"#SBATCH --nodes={nodes} --ntasks-per-node=1 --requeue\n{start}", wait=False)
    _wait_for_step(cluster, run_dir, 2)
    return job


def _left_alone(cluster: Cluster, run_dir: Path) -> None:
    """The job is gone from the controller and both nodes: no step, no launcher, no worker of it."""
    cluster.wait_jobs_gone()
    assert not run_processes(run_dir) and not cluster.steps()


def _stopped_at(output: str, run_dir: Path) -> int:
    """The step both nodes' ranks saved at on SIGTERM, as the launchers said it."""
    import re

    said = set(re.findall(r"launch: stopped by SIGTERM: checkpoint (\S+); continue", output))
    assert len(said) == 1, output
    step = int(said.pop().rpartition("step_")[2])
    assert (run_dir / "checkpoints" / f"step_{step:08d}").is_dir() and step < STEPS, output
    return step


def test_a_requeued_job_saves_and_resumes_by_itself(slurm: Cluster, conformance_dir: Path, tmp_path: Path) -> None:
    """`scontrol requeue` (what preemption does): SIGTERM to every process of the job, which saves; SLURM starts it
    again (SLURM_RESTART_COUNT=1, a rendezvous of its own) and it resumes from that checkpoint, with the losses of a
    run never interrupted."""
    run_dir = tmp_path / "run"
    job = _slow_job(slurm, tmp_path, run_dir)
    slurm.run("scontrol", "requeue", job)
    (tmp_path / "slow").unlink()  # the second attempt at full speed
    _left_alone(slurm, run_dir)
    output = (tmp_path / f"slurm-{job}.out").read_text()  # both attempts' (--open-mode=append)
    stopped = _stopped_at(output, run_dir)
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{stopped:08d}'}" in output, output
    said = slurm.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in said and "Restarts=1" in said, said
    reference, losses = _reference(conformance_dir), _losses(run_dir)
    assert sorted(losses) == sorted(reference) and max(abs(reference[s] - losses[s]) for s in losses) <= 1e-6


@pytest.mark.parametrize("full", [False, True], ids=["steps", "full"])
def test_scancel_term_saves_and_leaves_nothing(slurm: Cluster, tmp_path: Path, full: bool) -> None:
    """`scancel --signal=TERM`: the launchers and workers of the job's steps (`srun launch` on both nodes) get
    SIGTERM, save and end, with no process of the job left on either node. `--full` signals the batch script too:
    there srun turns its own SIGTERM into SIGKILL of its tasks (SLURM's srun does), so `--full` is for a batch
    script that runs `launch` itself (`exec launch ...`, one node), which saves alike."""
    run_dir = tmp_path / "run"
    job = _slow_job(slurm, tmp_path, run_dir, nodes=1 if full else 2)
    slurm.run("scancel", "--signal=TERM", *(["--full"] if full else []), job)
    _left_alone(slurm, run_dir)
    _stopped_at((tmp_path / f"slurm-{job}.out").read_text(), run_dir)


def test_scancel_then_a_resubmission_with_resume_continues(
    slurm: Cluster, conformance_dir: Path, tmp_path: Path
) -> None:
    """A plain `scancel` (SIGTERM, then SIGKILL after KillWait): the job ends; the same script submitted again with
    resume=<the first run's directory> continues from its checkpoint exactly."""
    first = tmp_path / "first"
    job = _slow_job(slurm, tmp_path, first)
    slurm.run("scancel", job)
    _left_alone(slurm, first)
    stopped = _stopped_at((tmp_path / f"slurm-{job}.out").read_text(), first)
    again = tmp_path / "again"
    command = " ".join([LAUNCH, *LONGER, *TWO_NODES, f"resume={first}", f"hydra.run.dir={again}"])
    job = _sbatch(slurm, tmp_path, f"#SBATCH --nodes=2 --ntasks-per-node=1\nsrun {command}")
    assert (
        f"resuming from {first / 'checkpoints' / f'step_{stopped:08d}'}" in (tmp_path / f"slurm-{job}.out").read_text()
    )
    reference, losses = _reference(conformance_dir), _losses(again)
    assert min(losses) == stopped + 1 and max(losses) == STEPS
    assert max(abs(reference[s] - losses[s]) for s in losses) <= 1e-6


@pytest.mark.parametrize(
    "shape,said",
    [
        (
            ["nodes=3", "gpus=1", "device=cpu", "batch.global_size=48"],
            "Requested node configuration is not available",
        ),  # pending forever
        (
            ["nodes=2", "gpus=8", "device=auto", "batch.global_size=64"],
            "Invalid generic resource (gres) specification",
        ),  # nodes without GPUs
    ],
    ids=["more-nodes-than-the-partition", "gpus-on-nodes-without"],
)
def test_an_allocation_slurm_cannot_give_is_one_line_at_submission(
    slurm: Cluster, tmp_path: Path, shape: list[str], said: str
) -> None:
    sweep = tmp_path / "sweep"
    argv = [LAUNCH, "-m", "hydra/launcher=submitit_slurm", *JOB, *shape, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(slurm, tmp_path), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("launch: error: SLURM cannot give this job its allocation (nodes=") and said in lines[0]
    assert not slurm.jobs() and not (sweep / ".submitit").exists()  # nothing submitted


def test_more_tasks_per_node_than_one_launcher_is_one_line_at_start(slurm: Cluster, tmp_path: Path) -> None:
    """`--ntasks-per-node=2` with gpus=2: two launchers per node would each start two workers. Every task says the
    same line and the job ends at once."""
    command = " ".join([LAUNCH, *JOB, "nodes=2", "gpus=2", f"hydra.run.dir={tmp_path / 'run'}"])
    job = _sbatch(slurm, tmp_path, f"#SBATCH --nodes=2 --ntasks-per-node=2\nsrun {command}", ok=False)
    output = (tmp_path / f"slurm-{job}.out").read_text()
    said = [line for line in output.splitlines() if line.startswith("launch: error:")]
    assert len(said) == 4 and len(set(said)) == 1, output
    assert "SLURM runs 2(x2) tasks per node, but each node needs exactly one launcher" in said[0], said
    assert "--ntasks-per-node=1" in said[0] and not (tmp_path / "run").exists()


def test_a_sweep_of_two_jobs_through_submitit_slurm(slurm: Cluster, conformance_dir: Path, tmp_path: Path) -> None:
    """Two jobs of two nodes each (a SLURM job array), micro-batches of 2 and 4 for one global batch: both log one
    process's losses, and the sweep's report lists both as done."""
    sweep = tmp_path / "sweep"
    argv = [
        LAUNCH,
        "-m",
        "hydra/launcher=submitit_slurm",
        *JOB,
        *TWO_NODES,
        "batch.micro_size=2,4",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(slurm, tmp_path), capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*.out"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr, logs)
    for n, accumulation in enumerate((4, 2)):
        assert json.loads((sweep / str(n) / "outcome.json").read_text())["code"] == 0
        assert f"x accumulation {accumulation} x world 2 = global 16" in logs, logs
        _exact(sweep / str(n), conformance_dir)
    table = (sweep / "summary.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| 0: batch.micro_size=2 | ddp | ok | "), table
    assert table[3].startswith("| 1: batch.micro_size=4 | ddp | ok | "), table


def test_a_requeued_submitit_job_resumes_by_itself(slurm: Cluster, conformance_dir: Path, tmp_path: Path) -> None:
    """`scontrol requeue` of a job submitted through submitit_slurm: the submission waits on, and the job's second
    attempt resumes from the first one's checkpoint, with an uninterrupted run's losses."""
    import time

    sweep, slow = tmp_path / "sweep", tmp_path / "slow"
    slow.touch()
    argv = [
        LAUNCH,
        "-m",
        "hydra/launcher=submitit_slurm",
        *LONGER,
        *_slow(slow),
        *TWO_NODES,
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=_env(slurm, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        while not (sweep / "0" / "metrics.jsonl").exists() or max(_losses(sweep / "0"), default=0) < 2:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        (job,) = slurm.jobs()
        slurm.run("scontrol", "requeue", job)
        slow.unlink()
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    logs = "".join(p.read_text() for p in sorted(sweep.glob(".submitit/*/*_log.*")))  # both attempts', both tasks'
    assert proc.returncode == 0, (out, err, logs)
    assert "launch: stopped by SIGTERM: checkpoint" in logs and "launch: SLURM requeues job" in logs, logs
    assert "resuming from" in logs and json.loads((sweep / "0" / "outcome.json").read_text())["code"] == 0, logs
    reference, losses = _reference(conformance_dir), _losses(sweep / "0")
    assert sorted(losses) == sorted(reference) and max(abs(reference[s] - losses[s]) for s in losses) <= 1e-6
