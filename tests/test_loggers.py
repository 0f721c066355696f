"""Every logger, read back with its own library: wandb (its offline run file), MLflow (`MlflowClient`, over the SQLite
store a run keeps in its run directory) and TensorBoard (`EventAccumulator`, the reader TensorBoard itself uses). One
run logs to the three at once; each holds every figure metrics.jsonl holds, at its step, and one run per job across
kills, restarts and resumes."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import TINY, Run, clean_env, launch, launch_here, launch_once
from omegaconf import OmegaConf
from wandb_records import find_run_file, read_history, read_records

ALL = "logger=[wandb,mlflow,tensorboard]"


def _env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path) | {"HOME": str(tmp_path)}  # no ~/.netrc: no API key anywhere, wandb logs offline


def _store(run_dir: Path) -> Path:
    """A run's local MLflow store (no tracking URI given)."""
    return run_dir / "mlflow" / "mlflow.db"


def _client(store: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{store}")


def _mlflow_run(store: Path, run_dir: Path) -> Any:
    return _client(store).get_run((run_dir / "mlflow_run_id").read_text().strip())


def _history(store: Path, run_dir: Path, key: str) -> list[tuple[int, float]]:
    """A metric of the job's MLflow run, in the order it was logged."""
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    history = _client(store).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def _events(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _texts(events: Any, tag: str) -> list[tuple[int, str]]:
    return [(t.step, t.tensor_proto.string_val[0].decode()) for t in events.Tensors(f"{tag}/text_summary")]


def _by_step(metrics: list[dict[str, Any]], which: str) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's figures per step: each step's first line (what wandb and MLflow keep: a redone step is not
    logged again) or its last (what TensorBoard shows: a redone step replaces the earlier attempt's)."""
    seen: dict[int, dict[str, Any]] = {}
    for m in metrics:
        if which == "last" or m["step"] not in seen:
            seen[m["step"]] = {k: v for k, v in m.items() if k not in ("step", "time")}
    return seen


@pytest.fixture(scope="session")
def logged(conformance_dir: Path) -> Run:
    """One run on 2 ranks logging to wandb, MLflow and TensorBoard at once (validation every 3rd step: figures logged
    on some steps only), made once per session whichever test process asks first."""
    overrides = [*(o for o in TINY if not o.startswith(("logger=", "trainer.eval_every"))), ALL, "gpus=2"]
    overrides += ["trainer.max_steps=6", "trainer.eval_every=3"]
    return launch_once(conformance_dir, *overrides, name="all-loggers", env=_env(conformance_dir)).check()


def test_wandb_offline_logs_the_runners_losses(logged: Run) -> None:
    run = logged
    history = [h for h in read_history(find_run_file(run.run_dir / "wandb")) if "loss" in h]
    assert [h["_step"] for h in history] == [m["step"] for m in run.metrics] == list(range(1, 7))
    assert [h["loss"] for h in history] == run.losses()
    assert "wandb sync" in run.stderr
    config = [r.run.config for r in read_records(find_run_file(run.run_dir / "wandb")) if r.HasField("run")]
    logged_config = {item.key: json.loads(item.value_json) for item in config[0].update}
    resolved = OmegaConf.to_container(OmegaConf.load(run.run_dir / "resolved.yaml"))
    for section in ("batch", "trainer", "optim", "model", "derived"):  # the run's whole resolved config, as it ran
        assert logged_config[section] == resolved[section], (section, logged_config.get(section), resolved[section])


def test_mlflow_holds_every_figure_the_config_and_the_status(logged: Run) -> None:
    """Every figure of every line of metrics.jsonl is an MLflow metric at its step, with the same value; every leaf of
    resolved.yaml a param; resolved.yaml an artifact; the run FINISHED, tagged with the job's run id."""
    from launcher.loggers.mlflow import flatten

    run_dir = logged.run_dir
    mlflow_run = _mlflow_run(_store(run_dir), run_dir)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == run_dir.name
    assert mlflow_run.data.tags["launch.run_id"] == (run_dir / "run_id").read_text().strip()
    expected = _by_step(logged.metrics, "first")
    assert len(expected) == 6 and sum("val_loss" in m for m in expected.values()) == 2  # steps 3 and 6
    keys = {k for m in expected.values() for k in m}
    assert set(mlflow_run.data.metrics) == keys, set(mlflow_run.data.metrics) ^ keys
    for key in keys:
        assert _history(_store(run_dir), run_dir, key) == [(s, m[key]) for s, m in expected.items() if key in m], key
    resolved = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    assert mlflow_run.data.params == flatten(resolved)
    assert mlflow_run.data.params["trainer.max_steps"] == "6" and mlflow_run.data.params["gpus"] == "2"
    artifact = _client(_store(run_dir)).download_artifacts(mlflow_run.info.run_id, "resolved.yaml", str(run_dir.parent))
    assert yaml.safe_load(Path(artifact).read_text()) == resolved
    assert f"mlflow: logging to run {mlflow_run.info.run_id} of experiment 'launch'" in logged.stderr


def test_tensorboard_holds_every_figure_and_the_config(logged: Run) -> None:
    """Every figure a scalar at its step (TensorBoard keeps float32: the same value, rounded so), the config as text,
    the status at the end."""
    events = _events(logged.run_dir / "tensorboard")
    expected = _by_step(logged.metrics, "last")
    keys = {k for m in expected.values() for k in m}
    assert set(events.Tags()["scalars"]) == keys, set(events.Tags()["scalars"]) ^ keys
    for key in keys:
        scalars = [(e.step, e.value) for e in events.Scalars(key)]
        assert scalars == [(s, float(np.float32(m[key]))) for s, m in expected.items() if key in m], key
    ((step, text),) = _texts(events, "config")
    resolved = yaml.safe_load((logged.run_dir / "resolved.yaml").read_text())
    assert step == 1 and yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == resolved
    assert _texts(events, "status") == [(6, "FINISHED")]


def _wandb_runs(run_dir: Path) -> list[tuple[str, list[int]]]:
    """Each offline run folder the job made, oldest first: the run id its file names, and the steps it logged."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda f: f.parent.name)
    return [
        (f.name.removeprefix("run-").removesuffix(".wandb"), [h["_step"] for h in read_history(f) if "loss" in h])
        for f in files
    ]


def _run_config(run_file: Path) -> tuple[dict, str]:
    """The config and the notes a run file records."""
    runs = [r.run for r in read_records(run_file) if r.HasField("run")]
    return {item.key: json.loads(item.value_json) for item in runs[0].config.update}, runs[0].notes


@pytest.mark.long  # ~30 s: kills and restarts; each logger's one run per job is also tested without them
def test_one_run_per_job_in_every_logger_across_kills_restarts_and_resumes(logged: Run, tmp_path: Path) -> None:
    """A worker killed twice: once restarted by the agent (trainer.max_restarts=1), which resumes from step 3 after
    step 5 was logged; once more, which ends the launch. `launch ... resume=<the run dir>` (a requeue) goes on from
    step 6 after step 8 was logged. One run throughout in wandb, MLflow and TensorBoard, its steps strictly increasing;
    a `resume=` into a new run directory is a new run that names it, stopped by a signal (KILLED). MLflow logs into a
    store named by its URI, as a team's shared one would be: the shared run's, in an experiment of its own (a new
    store's tables take seconds to make)."""
    env = _env(tmp_path)
    store = _store(logged.run_dir)
    kill = tmp_path / "kill"
    kill.touch()
    base = [
        *(o for o in TINY if not o.startswith("logger=")),
        ALL,
        "gpus=2",
        "trainer.checkpoint_every=3",
        f"logger.mlflow.tracking_uri=sqlite:///{store}",
        "logger.mlflow.experiment=continuity",
    ]
    job = [
        *base,
        "model._target_=faulty.KilledGPT",
        f"+model.while_there={kill}",
        "+model.at_call=21",  # 4 micro-batches a step: rank 1 dies in the 6th step of each attempt
        "trainer.max_restarts=1",
        "trainer.max_steps=12",
    ]
    failed = launch(tmp_path, *job, env=env)
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    assert "restart 1 of the worker group: resuming from" in failed.stdout and "step 3," in failed.stdout
    run_dir = failed.run_dir
    mlflow_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert _mlflow_run(store, run_dir).info.status == "FAILED"  # each failed attempt's rank 0 said so
    kill.unlink()
    again = launch(tmp_path, *job, f"resume={run_dir}", env=env).check()
    run_id = (run_dir / "run_id").read_text().strip()
    replayed = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert replayed == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 7, 8, 9, 10, 11, 12], replayed  # metrics.jsonl has them all

    # wandb: one run, three attempts (two of one launch, one of another), one axis: none logged again the steps it
    # replayed (4, 5; then 7, 8); each failed attempt's rank 0 finished its run, so what it logged reached the file.
    runs = _wandb_runs(run_dir)
    assert [i for i, _ in runs] == [run_id] * 3, runs
    assert [logged for _, logged in runs] == [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]], runs
    assert f"wandb: steps 4..5 are in run {run_id} already" in failed.stderr, failed.stderr
    assert f"wandb: steps 7..8 are in run {run_id} already" in again.stderr, again.stderr

    # MLflow: the same run continued (its id kept beside run_id), each step once, the first attempt's figures.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = _by_step(metrics, "first")
    assert (run_dir / "mlflow_run_id").read_text().strip() == mlflow_id
    assert _mlflow_run(store, run_dir).info.status == "FINISHED" and not (run_dir / "mlflow").exists()
    assert _history(store, run_dir, "loss") == [(s, m["loss"]) for s, m in first.items()]
    assert _history(store, run_dir, "restart") == [(s, m["restart"]) for s, m in first.items()]  # 0 0 0 0 0 1 1 1 0..
    assert f"mlflow: steps 4..5 are in run {mlflow_id} already" in failed.stderr, failed.stderr
    assert f"mlflow: continuing run {mlflow_id}" in again.stderr, again.stderr
    experiment = _client(store).get_experiment_by_name("continuity").experiment_id
    (only,) = _client(store).search_runs([experiment], filter_string=f"tags.`launch.run_id` = '{run_id}'")
    assert only.info.run_id == mlflow_id

    # TensorBoard: one folder, an event file per attempt; each attempt purges the scalars earlier ones logged from its
    # first step on: each step once, the last attempt's figures. Its config and how it ended are text, kept for each.
    events = _events(run_dir / "tensorboard")
    last = _by_step(metrics, "last")
    tensorboard = [(e.step, e.value) for e in events.Scalars("loss")]
    assert tensorboard == [(s, float(np.float32(m["loss"]))) for s, m in last.items()]
    assert [s for s, _ in _texts(events, "config")] == [1, 4, 7]
    assert _texts(events, "status") == [(5, "FAILED"), (8, "FAILED"), (12, "FINISHED")]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 3
    assert "tensorboard: steps 4..5 an earlier attempt logged" in failed.stderr, failed.stderr

    resolved = OmegaConf.load(run_dir / "resolved.yaml")
    assert resolved.job.run_id == run_id and resolved.job.continues is None
    manifest = json.loads((run_dir / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert manifest["run_id"] == run_id

    # resume= into a new run directory: a new run in each logger, which names the one it continues; a stop signal
    # (rank 1 sends SIGTERM to the launcher in step 14) ends it KILLED, its last checkpoint written.
    more_job = [*base, "model._target_=faulty.StoppedGPT", "+model.at_call=5", "trainer.max_steps=40"]
    more = launch(tmp_path, *more_job, f"resume={run_dir}", name="more", env=env)
    assert more.returncode == 128 + 15, (more.returncode, more.stderr)
    stopped_at = max(m["step"] for m in more.metrics)
    assert 14 <= stopped_at < 40, stopped_at
    steps = list(range(13, stopped_at + 1))
    (new_id, wandb_logged), *others = _wandb_runs(more.run_dir)
    assert not others and new_id != run_id and wandb_logged == steps, (new_id, wandb_logged, others)
    assert (more.run_dir / "run_id").read_text().strip() == new_id
    config, notes = _run_config(next((more.run_dir / "wandb").glob("offline-run-*/run-*.wandb")))
    assert config["job"]["run_id"] == new_id and config["job"]["continues"] == run_id, config["job"]
    assert notes == f"continues wandb run {run_id}", notes
    new_run = _mlflow_run(store, more.run_dir)
    assert new_run.info.status == "KILLED" and new_run.info.run_id != mlflow_id
    assert new_run.data.tags["launch.continues"] == run_id and new_run.data.tags["launch.run_id"] == new_id
    assert [s for s, _ in _history(store, more.run_dir, "loss")] == steps
    events = _events(more.run_dir / "tensorboard")
    assert [e.step for e in events.Scalars("loss")] == steps and _texts(events, "status") == [(stopped_at, "KILLED")]


# ------------------------------------------------------------------ refused before start, in the test process


@pytest.mark.unit
def test_several_loggers_each_under_its_name_over_its_own_schema(tmp_path: Path) -> None:
    """logger=[wandb,mlflow]: each logger's settings under its name, typed by its schema; a key one does not have is
    refused naming it, and a setting written without the logger's name says where it goes."""
    from hydra import compose, initialize_config_module

    from launcher.config import schema

    schema.register()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = compose("config", overrides=["logger=[wandb,mlflow,tensorboard]", "logger.mlflow.experiment=e"])
    assert list(cfg.logger) == ["wandb", "mlflow", "tensorboard"]
    types = [OmegaConf.get_type(node).__name__ for node in cfg.logger.values()]
    assert types == ["WandbConfig", "MlflowConfig", "TensorBoardConfig"] and cfg.logger.mlflow.experiment == "e"
    line = launch_here(tmp_path, "logger=[wandb,mlflow]", "logger.mlflow.project=x", name="a").refused()
    assert "logger.mlflow.project" in line, line
    line = launch_here(tmp_path, "logger=wandb", "logger.mode=offline", name="b").refused()
    assert "logger has: wandb" in line and "logger.wandb.mode=offline" in line, line
    mine = tmp_path / "my_conf" / "logger"  # a logger option of one's own, written without its name
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("_target_: launcher.loggers.wandb.WandbLogger\nmode: disabled\n")
    line = launch_here(tmp_path, "--config-dir", str(mine.parent), "logger=mine", *TINY[:5], name="c").refused()
    assert "start your option's file with '# @package logger.<its name>'" in line, line


@pytest.mark.unit
@pytest.mark.parametrize("logger", ["mlflow", "tensorboard"])
def test_a_logger_whose_package_is_missing_is_refused_naming_its_extra(
    logger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Missing:  # as an environment without the package: its import is not found
        @staticmethod
        def find_spec(name: str, *_: Any) -> None:
            if name.split(".")[0] == logger:
                raise ModuleNotFoundError(f"No module named '{name}'")

    monkeypatch.setattr(sys, "meta_path", [Missing(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, logger, raising=False)
    line = launch_here(tmp_path, *TINY, f"logger=[wandb,{logger}]", "logger.wandb.mode=disabled").refused()
    assert f"logger={logger} needs the {logger} package" in line and f"pip install 'launch[{logger}]'" in line, line


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the block ends: connections are refused


@pytest.mark.unit
def test_an_mlflow_store_that_cannot_be_used_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before start, in one line naming the URI, its credentials never shown: a server that refuses the
    connection, one that never answers (MLflow's own client, one try, CHECK_TIMEOUT seconds: here 1), credentials in
    the config, a SQLite store whose folder cannot be made."""
    from launcher.loggers import mlflow_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "keep").write_text("")  # a refused run removes the empty folders it leaves: not this one
    port = _closed_port()
    line = launch_here(
        tmp_path, *TINY, "logger=mlflow", f"logger.mlflow.tracking_uri=http://127.0.0.1:{port}"
    ).refused()
    assert f"the tracking store http://127.0.0.1:{port} cannot be used" in line, line
    assert "MLFLOW_TRACKING_URI" in line and "Traceback" not in line, line

    monkeypatch.setattr(mlflow_store, "CHECK_TIMEOUT", 1)
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        uri = f"http://alice:s3cret@127.0.0.1:{port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # from the environment: credentials there are the user's
        line = launch_here(tmp_path, *TINY, "logger=mlflow", name="silent").refused()
    assert f"http://***@127.0.0.1:{port} cannot be used" in line and "s3cret" not in line, line
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    line = launch_here(tmp_path, *TINY, "logger=mlflow", f"logger.mlflow.tracking_uri={uri}", name="secret").refused()
    assert "carries credentials" in line and "MLFLOW_TRACKING_PASSWORD" in line and "s3cret" not in line, line
    (tmp_path / "a_file").write_text("")
    store = f"sqlite:///{tmp_path / 'a_file' / 'mlflow.db'}"
    line = launch_here(tmp_path, *TINY, "logger=mlflow", f"logger.mlflow.tracking_uri={store}", name="db").refused()
    assert f"the MLflow store {store} cannot be made" in line, line


@pytest.mark.unit
def test_a_tensorboard_folder_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    folder = tmp_path / "a_file" / "tb"
    line = launch_here(tmp_path, *TINY, "logger=tensorboard", f"logger.tensorboard.log_dir={folder}").refused()
    assert f"logger.tensorboard.log_dir={folder} cannot be made" in line, line
    line = launch_here(tmp_path, *TINY, "logger=tensorboard", "logger.tensorboard.name=a/b", name="n").refused()
    assert "logger.tensorboard.name='a/b' is not a folder name" in line, line


@pytest.mark.unit
def test_an_mlflow_run_id_file_that_holds_no_id_is_refused_not_replaced(tmp_path: Path) -> None:
    from launcher.loggers.mlflow import _read_run_id

    assert _read_run_id(tmp_path / "mlflow_run_id") is None
    (tmp_path / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef\n")
    assert _read_run_id(tmp_path / "mlflow_run_id") == "0123456789abcdef0123456789abcdef"
    (tmp_path / "mlflow_run_id").write_text("../elsewhere\n")
    with pytest.raises(ValueError, match="not an MLflow run id .* delete it to start a new MLflow run"):
        _read_run_id(tmp_path / "mlflow_run_id")


@pytest.mark.unit
def test_the_loggers_get_the_config_without_the_rendezvous_secret_and_urls_without_credentials() -> None:
    from launcher.loggers.base import HIDDEN, run_config
    from launcher.loggers.mlflow_store import redact

    config = run_config(OmegaConf.create({"rdzv": {"secret": "t0ken", "port": 1}, "seed": 3}))
    assert config == {"rdzv": {"secret": HIDDEN, "port": 1}, "seed": 3}
    assert run_config(OmegaConf.create({"rdzv": {"secret": None}})) == {"rdzv": {"secret": None}}
    line = "HTTPConnectionPool: http://bob:pw@host:5000/api and postgresql://u:p@db/mlflow, not http://host/x@y"
    assert (
        redact(line)
        == "HTTPConnectionPool: http://***@host:5000/api and postgresql://***@db/mlflow, not http://host/x@y"
    )


def test_a_node_with_a_new_run_directory_continues_the_jobs_mlflow_run_and_a_lost_server_stops_no_run(
    logged: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kubernetes: a pod made again has a new, empty run directory, but the job's run id (derived from what the job
    shares): it finds the job's MLflow run by its tag and logs none of the steps MLflow holds again. A tracking store
    that stops answering mid-run is said once; the step goes on. (In the shared run's store, in an experiment of its
    own: a new store's tables take seconds to make.)"""
    from launcher.loggers.mlflow import MlflowLogger

    store = f"sqlite:///{logged.run_dir / 'mlflow' / 'mlflow.db'}"
    settings = {"tracking_uri": store, "experiment": "pods", "group": None, "name": None, "tags": {"team": "a"}}
    config = {"job": {"run_id": "k3x9a0qz"}, "trainer": {"max_steps": 9}}
    for pod in ("pod-0", "pod-1"):
        (tmp_path / pod).mkdir()
    first = MlflowLogger(config, str(tmp_path / "pod-0"), **settings)
    for step in (1, 2, 3):
        first.log({"loss": 4.0 - step}, step)
    first.finish("FAILED")
    again = MlflowLogger(config | {"trainer": {"max_steps": 12}}, str(tmp_path / "pod-1"), **settings)
    assert again.run_id == first.run_id == (tmp_path / "pod-1" / "mlflow_run_id").read_text().strip()
    for step in (3, 4):  # step 3 again: the checkpoint was at step 2
        again.log({"loss": 10.0 + step}, step)
    from mlflow.tracking import MlflowClient

    run = MlflowClient(store).get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.tags["team"] == "a"
    history = MlflowClient(store).get_metric_history(first.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 14.0)]
    assert run.data.params["trainer.max_steps"] == "9"  # a continued run keeps its first params: MLflow's rule
    err = capsys.readouterr().err
    assert f"mlflow: step 3 is in run {first.run_id} already" in err and "differ in trainer.max_steps" in err, err

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    again.client = MlflowClient(f"http://127.0.0.1:{_closed_port()}")  # the store gone
    again.uri = "http://127.0.0.1"
    for step in (5, 6, 7):
        again.log({"loss": 1.0}, step)
    err = capsys.readouterr().err
    assert err.count("could not be logged") == 1 and "step 5 could not be logged" in err, err
    assert "Connection refused" in err and "the run goes on" in err, err
    again.client = MlflowClient(store)
    again.log({"loss": 0.5}, 8)
    again.finish("FINISHED")
    err = capsys.readouterr().err
    assert "logging to run" in err and "again from step 8" in err and "3 logged step(s) did not reach run" in err, err
    steps = sorted(m.step for m in MlflowClient(store).get_metric_history(first.run_id, "loss"))
    assert steps == [1, 2, 3, 4, 8], steps
    assert MlflowClient(store).get_run(first.run_id).info.status == "FINISHED"
