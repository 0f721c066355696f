"""Beyond one machine and one run: rendezvous across nodes, SLURM through submitit, sweeps and their report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch, launch_here, launch_once
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from processes import free_port

from launcher.base.machine import ephemeral_port_floor
from launcher.clusters.slurm import expand_hostlist, submitit_overrides
from launcher.config import ConfigError, derive, freeze, schema
from launcher.elastic.rendezvous import rendezvous

schema.register()
JOB = [*TINY, "batch.global_size=16", "trainer.max_steps=5"]


def _compose(*overrides: str, hydra: bool = False):
    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=hydra)
    return cfg if hydra else freeze(cfg)


def _one_mlflow_parent_run_per_sweep(sweep: Path) -> None:
    """The jobs, run at once, share one MLflow store in the sweep directory; each job's run is nested under the sweep's
    parent run, which holds the sweep's report and chart and finished with it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{sweep / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("launch").experiment_id
    (parent,) = client.search_runs([experiment], filter_string="tags.`launch.group` = '" + sweep.name + "'")
    assert parent.info.run_name == sweep.name and parent.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == ["summary.md", "summary.png"]
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    ids = [(sweep / str(n) / "mlflow_run_id").read_text().strip() for n in (0, 1)]
    assert sorted(c.info.run_id for c in children) == sorted(ids) and all(c.info.status == "FINISHED" for c in children)
    for n, run_id in enumerate(ids):
        metrics = [json.loads(line) for line in (sweep / str(n) / "metrics.jsonl").read_text().splitlines()]
        history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(m["step"], m["loss"]) for m in metrics]
        assert client.get_run(run_id).info.run_name == f"{sweep.name}-{n}"


@pytest.mark.unit
def test_expand_hostlist() -> None:
    """SLURM's documented forms (`scontrol show hostnames`): ranges and lists, zero padding, several bracket
    groups (the first varies slowest), text after a bracket, several expressions."""
    assert expand_hostlist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a[9-11]") == ["a9", "a10", "a11"]
    assert expand_hostlist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert expand_hostlist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert expand_hostlist("tux[008-010],lx[1,3]-eth0,head") == [
        "tux008",
        "tux009",
        "tux010",
        "lx1-eth0",
        "lx3-eth0",
        "head",
    ]


SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "localhost,gpu08",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_RESTART_COUNT": "3",
}


@pytest.mark.unit
def test_rendezvous_inside_a_slurm_allocation() -> None:
    cfg = _compose("nodes=2", "gpus=8", "batch.global_size=64", "batch.micro_size=4", "rdzv.secret=5ec2e7")
    derived = derive(cfg, cuda_devices=8)
    r = rendezvous(cfg, derived, SLURM)
    host, port = r.endpoint.split(":")
    assert host == "localhost" and r.run_id == "slurm-4242-3-5ec2e7" and r.backend == "c10d" and r.local_addr is None
    assert 10000 <= int(port) < ephemeral_port_floor()  # where the kernel never hands a port out by itself
    assert rendezvous(cfg, derived, SLURM | {"SLURM_RESTART_COUNT": "4"}).run_id != r.run_id  # a requeue meets anew
    # The secret, made at submission, is part of the id and the port: the job id alone does not find them.
    other = _compose("nodes=2", "gpus=8", "batch.global_size=64", "batch.micro_size=4", "rdzv.secret=0ther")
    assert rendezvous(other, derived, SLURM).endpoint != r.endpoint
    static = rendezvous(_compose("nodes=2", "gpus=8", "batch.global_size=64", "rdzv.backend=static"), derived, SLURM)
    assert static.configs["rank"] == 1


@pytest.mark.unit
def test_a_first_node_without_an_address_is_one_line() -> None:
    """No scontrol on PATH to ask for the node's NodeAddr, and a name that does not resolve: said at once, not after
    the store's minute of retries."""
    cfg = _compose("nodes=2", "gpus=8", "batch.global_size=64", "rdzv.secret=5ec2e7")
    with pytest.raises(
        ConfigError,
        match=r"first node gpu07\.invalid is where its nodes meet, but the host "
        r"gpu07\.invalid of gpu07\.invalid:\d+ has no address here .*rdzv\.endpoint=ADDRESS:\d+",
    ):
        rendezvous(cfg, derive(cfg, cuda_devices=8), SLURM | {"SLURM_JOB_NODELIST": "gpu07.invalid,gpu08"})
    given = _compose("nodes=2", "gpus=8", "batch.global_size=64", "rdzv.endpoint=gpu07.invalid:29500", "rdzv.id=x")
    with pytest.raises(ConfigError, match=r"rdzv.endpoint=gpu07.invalid:29500: the host gpu07.invalid"):
        rendezvous(given, derive(given, cuda_devices=8), {})


@pytest.mark.unit
def test_one_node_stays_on_loopback_even_inside_slurm() -> None:
    """Two single-node launches in one allocation must not meet on a port derived from the job id."""
    cfg = _compose("gpus=2", "batch.global_size=64")
    one = SLURM | {"SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu07"}
    first, second = (rendezvous(cfg, derive(cfg, cuda_devices=2), one) for _ in range(2))
    assert first.endpoint == second.endpoint == "127.0.0.1:0" and first.local_addr == "127.0.0.1"
    assert first.run_id != second.run_id


@pytest.mark.unit
def test_submission_adds_a_rendezvous_secret() -> None:
    first, second = (submitit_overrides(["hydra/launcher=submitit_slurm", "nodes=2"]) for _ in range(2))
    secrets = [o for o in first + second if o.startswith("rdzv.secret=")]
    assert len(secrets) == 2 and secrets[0] != secrets[1] and len(secrets[0]) > len("rdzv.secret=") + 8
    assert not any(
        o.startswith("rdzv.secret=") for o in submitit_overrides(["hydra/launcher=submitit_slurm", "rdzv.secret=mine"])
    )


@pytest.mark.parametrize(
    "env,message",
    [
        ({"SLURM_NNODES": "4"}, "nodes=2 but this SLURM allocation has 4 node(s); use nodes=4"),
        ({"SLURM_NTASKS_PER_NODE": "8"}, "submit with --ntasks-per-node=1 (through submitit: hydra.launcher.tasks"),
        ({"SLURM_GPUS_ON_NODE": "4"}, "gpus=8 but SLURM gave this node 4 GPU(s)"),
    ],
)
@pytest.mark.unit
def test_slurm_mismatches_are_one_line_errors(env: dict[str, str], message: str) -> None:
    cfg = _compose("nodes=2", "gpus=8", "batch.global_size=64")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rendezvous(cfg, derive(cfg, cuda_devices=8), SLURM | env)


@pytest.mark.unit
def test_several_nodes_need_an_endpoint(tmp_path: Path) -> None:
    assert (
        "nodes=2 needs rdzv.endpoint=HOST:PORT and rdzv.id=NAME"
        in launch_here(tmp_path, *JOB, "nodes=2", "gpus=1").refused()
    )


def _two_nodes(tmp_path: Path, env_for_node, *overrides: str, dirs: tuple[str, str] = ("shared", "shared")):
    """Two launchers of one job, one worker each; returns their (returncode, stdout, stderr)."""
    procs = [
        subprocess.Popen(
            [LAUNCH, *JOB, "nodes=2", "gpus=1", *overrides, f"hydra.run.dir={tmp_path / dirs[n]}"],
            cwd=tmp_path,
            env=env_for_node(n),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _one_node(conformance_dir: Path) -> list[float]:
    return launch_once(conformance_dir, *JOB, "gpus=2", name="cluster-one-node").check().losses()


@pytest.mark.long  # ~25 s: the scale tier rehearses 32 nodes on loopback; the rendezvous inside an
# allocation is tested in process above
def test_two_nodes_on_loopback_match_one_node_and_resume_from_their_shared_directory(
    conformance_dir: Path, tmp_path: Path
) -> None:
    env = lambda n: clean_env(tmp_path)  # noqa: E731
    results = _two_nodes(tmp_path, env, f"rdzv.endpoint=127.0.0.1:{free_port()}", "rdzv.id=loopback")
    assert [r[0] for r in results] == [0, 0], results
    two = list(_losses(tmp_path / "shared").values())
    one_node = _one_node(conformance_dir)
    assert max(abs(a - b) for a, b in zip(one_node, two, strict=True)) <= 1e-6, (one_node, two)
    # The same job, longer: both nodes continue from the checkpoint they wrote together.
    again = _two_nodes(
        tmp_path, env, f"rdzv.endpoint=127.0.0.1:{free_port()}", "rdzv.id=loopback2", "trainer.max_steps=7"
    )
    assert [r[0] for r in again] == [0, 0], again
    out = "".join(r[1] for r in again)
    assert f"resuming from {tmp_path / 'shared' / 'checkpoints' / 'step_00000005'} (step 5" in out, out
    assert sorted(_losses(tmp_path / "shared")) == [1, 2, 3, 4, 5, 6, 7]


def test_nodes_without_a_shared_directory_stop_at_start(tmp_path: Path) -> None:
    """Each node with a folder of its own: rank 1 cannot see what rank 0 writes, so no checkpoint would be whole."""
    results = _two_nodes(
        tmp_path,
        lambda n: clean_env(tmp_path),
        f"rdzv.endpoint=127.0.0.1:{free_port()}",
        "rdzv.id=apart",
        dirs=("node0", "node1"),
    )
    assert [r[0] for r in results] == [1, 1], results
    err = "".join(r[2] for r in results)
    assert "rank 1 (on " in err and "does not see" in err and "shared run directory" in err, err
    said = [line for _, _, e in results for line in e.splitlines() if line.startswith("launch: error:")]
    assert len(said) == 2 and all(f"does not see {tmp_path / 'node0'} as rank 0 wrote it" in s for s in said), said
    assert not (tmp_path / "node0" / "checkpoints").exists() and not (tmp_path / "node1" / "checkpoints").exists()


@pytest.mark.long  # ~20 s: the rendezvous inside an allocation is tested in process above, a real one in test_slurm
def test_a_slurm_allocation_needs_no_rendezvous_settings(conformance_dir: Path, tmp_path: Path) -> None:
    """Two launchers with the environment SLURM gives each node's task; nothing set by hand."""
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NTASKS_PER_NODE": "1"}
    results = _two_nodes(
        tmp_path, lambda n: clean_env(tmp_path) | env | {"SLURM_NODEID": str(n)}, f"rdzv.port={free_port()}"
    )
    assert [r[0] for r in results] == [0, 0], results
    two, one_node = list(_losses(tmp_path / "shared").values()), _one_node(conformance_dir)
    assert max(abs(a - b) for a, b in zip(one_node, two, strict=True)) <= 1e-6, (one_node, two)


def test_a_node_that_never_arrives_ends_the_job_with_a_clear_error(tmp_path: Path) -> None:
    run = launch(  # a node that waits forever fails by the call's timeout
        tmp_path,
        *JOB,
        "nodes=2",
        "gpus=1",
        f"rdzv.endpoint=127.0.0.1:{free_port()}",
        "rdzv.id=alone",
        "rdzv.join_timeout=5",
    )
    assert run.returncode == 1 and "did not all join rendezvous" in run.stderr, run.stderr


def test_the_sbatch_script_asks_for_the_runs_shape(tmp_path: Path) -> None:
    """The script Hydra's submitit_slurm launcher submits, made by the plugin and submitit from our config: an
    `sbatch` on PATH keeps a copy of what it is given (`sbatch --test-only` of it, before any submission) and refuses
    it (there is no cluster here; tests/test_slurm.py submits to a real one)."""
    bin_dir, script = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/sh\nfor a in "$@"; do case "$a" in *.sh) cp "$a" "$SBATCH_COPY";; esac; done\nexit 1\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit believes it is on a cluster when srun is there
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = clean_env(tmp_path) | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SBATCH_COPY": str(script)}
    argv = [
        "-m",
        "hydra/launcher=submitit_slurm",
        *TINY,
        "device=auto",
        "nodes=2",
        "gpus=8",
        "batch.global_size=64",
        "hydra.launcher.partition=gpu",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    proc = subprocess.run([LAUNCH, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert script.exists(), proc.stderr
    text = script.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
    ):
        assert line in text, text


@pytest.mark.unit
@pytest.mark.parametrize(
    "override,message",
    [
        ("hydra.launcher.tasks_per_node=8", "hydra.launcher.tasks_per_node=8 contradicts the run's shape"),
        ("hydra.launcher.nodes=3", "hydra.launcher.nodes=3 contradicts the run's shape; use hydra.launcher.nodes=2"),
    ],
)
def test_a_contradicting_submitit_shape_is_refused(tmp_path: Path, override: str, message: str) -> None:
    assert message in launch_here(tmp_path, "-m", "hydra/launcher=submitit_local", *JOB, "nodes=2", override).refused()


@pytest.mark.long
def test_submitit_local_sweep_with_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = launch(
        tmp_path,
        "-m",
        "hydra/launcher=submitit_local",
        *[o for o in JOB if not o.startswith("logger")],
        "logger=[wandb,mlflow,tensorboard]",
        "logger.wandb.mode=disabled",
        "gpus=2",
        "batch.micro_size=2,4",
        f"hydra.sweep.dir={sweep}",
    )
    assert run.returncode == 0, run.stderr
    resolved = [OmegaConf.load(sweep / str(n) / "resolved.yaml") for n in (0, 1)]
    assert [r.derived.accumulation for r in resolved] == [4, 2]
    for logger in ("wandb", "mlflow", "tensorboard"):  # one group per sweep in each logger, one run per job
        assert resolved[0].logger[logger].group == resolved[1].logger[logger].group == sweep.name
        assert resolved[0].logger[logger].name != resolved[1].logger[logger].name
    _one_mlflow_parent_run_per_sweep(sweep)
    for n in (0, 1):  # TensorBoard: each job's events in its own folder (`tensorboard --logdir <sweep>` shows both)
        assert len(list((sweep / str(n) / "tensorboard").glob("events.out.tfevents.*"))) == 1
    table = (sweep / "summary.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| 0: batch.micro_size=2 | ddp | ok | ") and "| 2 | 4 |" in table[2]
    assert "job  " in run.stdout and " ok " in run.stdout  # the outcome table on the terminal
    assert (sweep / "summary.png").stat().st_size > 10_000
    # The columns are what each job logged: its last loss and model-state bytes, its median samples/s.
    for n, row in enumerate(table[2:]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        metrics = [json.loads(line) for line in (sweep / str(n) / "metrics.jsonl").read_text().splitlines()]
        assert float(cells[6]) == pytest.approx(metrics[-1]["loss"], abs=5e-5), (row, metrics[-1])
        assert int(cells[8].replace(",", "")) == round(metrics[-1]["model_state_bytes"]), row
        rates = sorted(m["samples_per_s"] for m in metrics if "samples_per_s" in m)
        assert rates[0] - 0.05 <= float(cells[7]) <= rates[-1] + 0.05, (row, rates)
    # python -m launcher.search.report rebuilds both from the jobs' folders alone.
    expected = (sweep / "summary.md").read_text()
    (sweep / "summary.md").unlink()
    (sweep / "summary.png").unlink()
    subprocess.run([sys.executable, "-m", "launcher.search.report", str(sweep)], check=True, env=clean_env(tmp_path))
    assert (sweep / "summary.md").read_text() == expected and (sweep / "summary.png").stat().st_size > 10_000


@pytest.mark.unit
def test_sweep_configs_name_only_existing_choices() -> None:
    from importlib import resources

    conf = resources.files("launcher.conf")
    strategies = {p.name[:-5] for p in (conf / "strategy").iterdir() if p.name.endswith(".yaml")}
    for name in ("strategies", "batch_scaling", "smoke"):
        cfg = _compose(f"+sweep={name}", hydra=True)
        params = cfg.hydra.sweeper.params
        assert params, name
        if "strategy" in params:
            assert set(params.strategy.split(",")) <= strategies


@pytest.mark.unit
def test_rendezvous_events_are_named_without_reading_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's dynamic rendezvous names each event by the calling method; the launcher's name for it reads frames,
    never `inspect.stack()` (which reads every frame's source file)."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from launcher.adapters.torch_private import cheap_event_names

    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)  # restored after
    cheap_event_names()

    def stack(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("inspect.stack() was called")

    monkeypatch.setattr(inspect, "stack", stack)

    class Handler:
        def _record(self) -> str:
            return dynamic_rendezvous.get_method_name()  # as torch's handlers call it: depth 2 is _record's caller

        def next_rendezvous(self) -> str:
            return self._record()

    assert Handler().next_rendezvous() == "next_rendezvous"


@pytest.mark.unit
def test_the_real_slurm_tests_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where SLURM's commands are missing, tests/test_slurm.py skips with one line naming the packages to install."""
    from slurm_cluster import missing

    monkeypatch.setenv("PATH", "/nonexistent")
    said = missing()
    assert said is not None and "sbatch" in said and "apt-get install --no-install-recommends slurm-wlm" in said, said
