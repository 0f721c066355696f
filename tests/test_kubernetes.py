"""Kubernetes (launcher/clusters/kubernetes.py): a PyTorchJob or JobSet pod joins as its node, `launch export
kubeflow` writes the PyTorchJob, and a launch inside torchrun's workers (launcher/clusters/torchrun.py) is refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import LAUNCH, TINY, clean_env, cli_here, launch_here, launch_once
from hydra import compose, initialize_config_module
from processes import free_port

from launcher.clusters import shaped
from launcher.config import ConfigError, derive, freeze, schema
from launcher.elastic.rendezvous import rendezvous

schema.register()
JOB = [*TINY, "batch.global_size=16", "trainer.max_steps=5"]


def _frozen(*overrides: str):
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return freeze(compose("config", overrides=list(overrides)))


def _pod(rank: int, port: int, nodes: int = 2, nproc: str = "8") -> dict[str, str]:
    """What Kubeflow's training operator gives the container of a PyTorchJob's pod `rank`."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": "train-master-0",
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": "train-master-0",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nodes * int(nproc) if nproc.isdigit() else nodes),
        "RANK": str(rank),  # the pod's, not a process's: a node-level job is around it
    }


@pytest.mark.unit
def test_a_pytorchjob_pod_takes_its_shape_and_rendezvous_from_the_operator() -> None:
    cfg = shaped(_frozen("batch.global_size=64"), _pod(1, 23456), given=[])
    assert (cfg.nodes, cfg.gpus) == (2, 8)
    derived = derive(cfg, cuda_devices=8)
    assert (derived.world_size, derived.accumulation) == (16, 1)
    r = rendezvous(cfg, derived, _pod(1, 23456))
    # The operator's node order (static rendezvous: the master pod, rank 0, hosts the store at its address).
    assert (r.endpoint, r.backend, r.configs["rank"], r.job.cluster) == (
        "train-master-0:23456",
        "static",
        1,
        "kubernetes",
    )
    assert r.job.shared_run_dir is False  # pods share no POSIX file system
    # nproc "auto" (torchrun's word for one per device) leaves gpus to the launcher
    assert shaped(_frozen(), _pod(0, 1, nproc="auto"), given=[]).gpus is None


@pytest.mark.unit
def test_an_etcd_rendezvous_asked_of_a_pytorchjob_is_one_line() -> None:
    """The operator's pods meet by its static rendezvous: rdzv.backend=etcd-v2 is refused, not replaced in silence."""
    cfg = shaped(_frozen("batch.global_size=64", "rdzv.backend=etcd-v2"), _pod(1, 23456), given=[])
    with pytest.raises(ConfigError) as e:
        rendezvous(cfg, derive(cfg, cuda_devices=8), _pod(1, 23456))
    assert str(e.value) == (
        "rdzv.backend=etcd-v2: a kubernetes job's nodes meet by its own static rendezvous, ranks as it numbers them; "
        "leave rdzv.backend out"
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "given,env,message",
    [
        (
            ["nodes=4"],
            _pod(0, 1),
            "nodes=4 on the command line, but this kubernetes job's PET_NNODES=2; drop nodes= "
            "(it is taken from PET_NNODES) or make them agree",
        ),
        (["gpus=2"], _pod(0, 1), "gpus=2 on the command line, but this kubernetes job's PET_NPROC_PER_NODE=8"),
        ([], _pod(0, 1) | {"PET_NNODES": "1:4"}, "PET_NNODES=1:4 is not a number of the kind a fixed-size job has"),
    ],
)
def test_what_the_command_line_says_must_agree_with_the_pod(
    given: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        shaped(_frozen(*given), env, given=given)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.unit
def test_a_jobset_pod_meets_the_first_pod_by_its_name() -> None:
    env = {"JOBSET_NAME": "llm", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "2"}
    cfg = shaped(_frozen("nodes=4", "gpus=8", "batch.global_size=64", "batch.micro_size=2"), env, given=["nodes=4"])
    r = rendezvous(cfg, derive(cfg, cuda_devices=8), env)
    assert (r.endpoint, r.configs["rank"], r.backend) == ("llm-workers-0-0.llm:29500", 2, "static")
    with pytest.raises(ConfigError, match=r"^this pod is node 2 of a job of nodes=2; give every pod the same nodes=N"):
        small = _frozen("nodes=2", "gpus=8", "batch.global_size=64")
        rendezvous(small, derive(small, cuda_devices=8), env)


@pytest.mark.unit
@pytest.mark.parametrize(
    "env,command",
    [
        (
            {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
            "launch gpus=2 ...your overrides",
        ),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"},
            "launch nodes=2 gpus=4 rdzv.endpoint=n0:29500 rdzv.id=NAME ...your overrides",
        ),
    ],
    ids=["torchrun", "a lone RANK"],
)
def test_a_launch_inside_torchrun_is_refused_with_the_command_to_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], command: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = launch_here(tmp_path, *TINY).refused()
    assert line.startswith("launch: error: this process was started by torchrun or another elastic agent ("), line
    assert "launch starts its own workers and replaces torchrun" in line and line.endswith(command), line


def _manifest(*args: str) -> dict:
    proc = subprocess.run([LAUNCH, "export", "kubeflow", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.unit
def test_export_refuses_what_a_run_would_refuse(tmp_path: Path) -> None:
    cases = {
        (
            "image=x",
            "gpus=8",
            "nodes=2",
            "batch.global_size=30",
            "trainer.checkpoint_dir=s3://b/p",
        ): "batch.global_size=30 is not divisible",
        ("image=x", "nodes=2"): "gpus is unset; give gpus=N, the workers (GPUs) of each pod",
        ("image=x", "nodes=2", "gpus=8", "batch.global_size=64"): "the 2 pods share no file system: give "
        "trainer.checkpoint_dir=s3://bucket/prefix",
        ("gpus=1",): "usage: launch export kubeflow image=IMAGE",
        ("image=x", "gpus=1", "name=My_Job"): "name=My_Job is not a Kubernetes object name",
        ("image=x", "gpus=1", "trainer.max_stpes=3"): "unknown key 'trainer.max_stpes'",
        ("image=x", "gpus=2", "nodes=1:2", "trainer.max_restarts=2", "trainer.checkpoint_dir=s3://b/p"): "nodes=1:2 is "
        "an elastic range, but a PyTorchJob has a fixed number of pods; give nodes=N",
    }
    for args, message in cases.items():
        run = cli_here(tmp_path, "export", "kubeflow", *args)
        assert run.returncode == 2 and run.stdout == "", (args, run)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"launch: error: {message}"), (args, run.stderr)


def _pods(tmp_path: Path, command: list[str], extra_env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """The two pods of a PyTorchJob, each with its own disk (run directory), started as the operator starts them (its
    variables, the master's address on loopback); their (exit code, stdout, stderr)."""
    port, procs = free_port(), []
    for rank in range(2):
        loopback = {"PET_MASTER_ADDR": "127.0.0.1", "MASTER_ADDR": "127.0.0.1"}  # the master pod's address, here
        env = clean_env(tmp_path) | _pod(rank, port, nproc="1") | loopback | (extra_env or {})
        args = [*command[1:-1], f"hydra.run.dir={tmp_path / f'pod{rank}'}"]  # the manifest's, on this pod's disk
        procs.append(
            subprocess.Popen(
                [LAUNCH, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


@pytest.mark.long
def test_the_exported_pytorchjob_runs_as_two_pods_that_match_one_node(conformance_dir: Path, tmp_path: Path) -> None:
    """The manifest names the run's overrides; its pods, started with the environment the operator gives them (on
    loopback), join as nodes 0 and 1, train as one node of 2 ranks does, and keep their checkpoints in object storage
    (moto's S3 server): the pods share no file system. Without a shared checkpoint folder they stop before the first
    step, saying so."""
    from object_store import s3_server

    with s3_server() as s3:
        url = s3.url("k8s/tiny")
        job = _manifest(
            "image=registry.local/train:1", "name=tiny", *JOB, "nodes=2", "gpus=1", f"trainer.checkpoint_dir={url}"
        )
        assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "tiny")
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert (specs["Master"]["replicas"], specs["Worker"]["replicas"], job["spec"]["nprocPerNode"]) == (1, 1, "1")
        pods = [specs[kind]["template"]["spec"]["containers"][0] for kind in ("Master", "Worker")]
        assert all(pod["image"] == "registry.local/train:1" and pod["name"] == "pytorch" for pod in pods)
        command = pods[0]["command"]
        assert command[0] == "launch" and command[1:-1] == [*JOB, "nodes=2", "gpus=1", f"trainer.checkpoint_dir={url}"]
        assert pods[1]["command"] == command and command[-1].startswith("hydra.run.dir=")
        results = _pods(tmp_path, command, s3.env)
        assert [r[0] for r in results] == [0, 0], results
        assert "node 0 of a kubernetes job" in results[0][1] and "node 1 of a kubernetes job" in results[1][1], results
        saved = sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(url.removeprefix("s3://")))
        assert "step_00000005" in saved, saved  # both pods' shards and the manifest, in the bucket
        assert not (tmp_path / "pod0" / "checkpoints").exists() and not (tmp_path / "pod1" / "checkpoints").exists()
    metrics = (tmp_path / "pod0" / "metrics.jsonl").read_text().splitlines()
    two = [json.loads(line)["loss"] for line in metrics]
    one = launch_once(conformance_dir, *JOB, "gpus=2", name="cluster-one-node").check().losses()
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-6, (one, two)
    assert not (tmp_path / "pod1" / "metrics.jsonl").exists()  # metrics are rank 0's, in its pod's run directory
    apart = tmp_path / "apart"
    apart.mkdir()
    results = _pods(apart, ["launch", *JOB, "nodes=2", "gpus=1", "hydra.run.dir=/workspace/run"])
    assert [r[0] for r in results] == [1, 1], results
    err = "".join(r[2] for r in results)
    assert (
        "does not see" in err
        and "the nodes of one run need one checkpoint folder; set trainer.checkpoint_dir to "
        "an object-store URL (s3://bucket/prefix)"
        in err
    ), err
    assert not (apart / "pod0" / "metrics.jsonl").exists()  # stopped before the first step
