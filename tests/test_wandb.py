"""Real wandb, offline: with no API key the run logs offline by itself, and what it logged reads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, Run, clean_env, launch
from omegaconf import OmegaConf
from wandb_records import find_run_file, read_history, read_records


def test_wandb_offline_logs_the_runners_losses(tmp_path: Path) -> None:
    env = clean_env(tmp_path) | {"HOME": str(tmp_path)}  # no ~/.netrc: no API key anywhere
    overrides = [o for o in TINY if not o.startswith("logger=")]
    run = launch(tmp_path, *overrides, "logger=wandb", "gpus=2", "trainer.max_steps=6", env=env).check()
    history = [h for h in read_history(find_run_file(run.run_dir / "wandb")) if "loss" in h]
    assert [h["_step"] for h in history] == [m["step"] for m in run.metrics] == list(range(1, 7))
    assert [h["loss"] for h in history] == run.losses()
    assert "wandb sync" in run.stderr
    config = [r.run.config for r in read_records(find_run_file(run.run_dir / "wandb")) if r.HasField("run")]
    logged = {item.key: json.loads(item.value_json) for item in config[0].update}
    resolved = OmegaConf.to_container(OmegaConf.load(run.run_dir / "resolved.yaml"))
    for section in ("batch", "trainer", "optim", "model", "derived"):  # the run's whole resolved config, as it ran
        assert logged[section] == resolved[section], (section, logged.get(section), resolved[section])


def test_logger_none_writes_no_wandb_files(one_process: Run) -> None:
    run = one_process  # the conformance suite's one-process run, logger=none
    assert len(run.metrics) == 12 and not (run.run_dir / "wandb").exists()
    assert not list(run.run_dir.rglob("*.wandb")), list(run.run_dir.rglob("*.wandb"))


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


def test_one_wandb_run_per_job_on_one_step_axis_across_kills_restarts_and_resumes(tmp_path: Path) -> None:
    """A worker killed twice: once restarted by the agent (trainer.max_restarts=1), which resumes from step 3 after
    step 5 was logged; once more, which ends the launch. `launch ... resume=<the run dir>` (a requeue) goes on from
    step 6 after step 8 was logged. One wandb run throughout, its steps strictly increasing across its three offline
    folders; a `resume=` into a new run directory is a new run that names it."""
    env = clean_env(tmp_path) | {"HOME": str(tmp_path)}  # no ~/.netrc: no API key anywhere
    kill = tmp_path / "kill"
    kill.touch()
    job = [
        *(o for o in TINY if not o.startswith("logger=")),
        "logger=wandb",
        "gpus=2",
        "model._target_=faulty.KilledGPT",
        f"+model.while_there={kill}",
        "+model.at_call=21",  # 4 micro-batches a step: rank 1 dies in the 6th step of each attempt
        "trainer.checkpoint_every=3",
        "trainer.max_restarts=1",
        "trainer.max_steps=12",
    ]
    failed = launch(tmp_path, *job, env=env)
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    assert "restart 1 of the worker group: resuming from" in failed.stdout and "step 3," in failed.stdout
    run_dir = failed.run_dir
    kill.unlink()
    again = launch(tmp_path, *job, f"resume={run_dir}", env=env).check()
    run_id = (run_dir / "run_id").read_text().strip()
    runs = _wandb_runs(run_dir)
    assert [i for i, _ in runs] == [run_id] * 3, runs  # one run, three attempts: two of one launch, one of another
    # One axis, strictly increasing across the attempts: none logged again the steps it replayed (4, 5; then 7, 8);
    # each failed attempt's rank 0 finished its run, so what it logged reached wandb's file.
    assert [logged for _, logged in runs] == [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]], runs
    assert f"wandb: steps 4..5 are in run {run_id} already" in failed.stderr, failed.stderr
    assert f"wandb: steps 7..8 are in run {run_id} already" in again.stderr, again.stderr
    replayed = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert replayed == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 7, 8, 9, 10, 11, 12], replayed  # metrics.jsonl has them all
    resolved = OmegaConf.load(run_dir / "resolved.yaml")
    assert resolved.job.run_id == run_id and resolved.job.continues is None
    manifest = json.loads((run_dir / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert manifest["run_id"] == run_id

    more = launch(tmp_path, *job, "trainer.max_steps=14", f"resume={run_dir}", name="more", env=env).check()
    (new_id, logged), *others = _wandb_runs(more.run_dir)
    assert not others and new_id != run_id and logged == [13, 14], (new_id, logged, others)
    assert (more.run_dir / "run_id").read_text().strip() == new_id
    config, notes = _run_config(next((more.run_dir / "wandb").glob("offline-run-*/run-*.wandb")))
    assert config["job"]["run_id"] == new_id and config["job"]["continues"] == run_id, config["job"]
    assert notes == f"continues wandb run {run_id}", notes


@pytest.mark.unit
def test_the_launchers_of_one_run_directory_agree_on_one_run_id(tmp_path: Path) -> None:
    """Eight launchers (the nodes of one job) prepare one shared run directory at once: the first writes its id,
    the others read it; a later launch reads it too."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from launcher.checkpoint.format import RUN_ID_PATTERN
    from launcher.run_id import make_run_id, read_run_id

    start = threading.Barrier(8)

    def make(_: int) -> str:
        start.wait()
        return make_run_id(tmp_path)

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(make, range(8)))
    assert len(ids) == 1 and RUN_ID_PATTERN.fullmatch(next(iter(ids))), ids
    assert read_run_id(tmp_path) == make_run_id(tmp_path) == (tmp_path / "run_id").read_text().strip() in ids
    slow = tmp_path / "slow"  # the first launcher created the file and has not written it yet: the others wait
    slow.mkdir()
    (slow / "run_id").touch()
    threading.Timer(0.3, (slow / "run_id").write_text, ["k3x9a0qz\n"]).start()
    assert make_run_id(slow) == "k3x9a0qz"


@pytest.mark.unit
def test_a_run_id_file_that_holds_no_id_is_refused_before_the_claim(tmp_path: Path) -> None:
    """Not replaced: a new id would split the run's history silently. Refused in one line naming the file and the
    fix, before the run directory is claimed (nothing written)."""
    from launcher.config import ConfigError
    from launcher.run_id import claim_run

    (tmp_path / "run_id").write_text("../not an id\n")
    with pytest.raises(ConfigError) as e:
        claim_run(OmegaConf.create({"job": {"config_hash": "0" * 16}}), tmp_path, None, None)
    line = str(e.value)
    assert "\n" not in line and str(tmp_path / "run_id") in line and "'../not an id'" in line, line
    assert "delete it to start a new logger run" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_id"]  # no claim, no lock


@pytest.mark.unit
def test_nodes_that_share_no_run_directory_derive_one_run_id_from_their_job(tmp_path: Path) -> None:
    """Kubernetes: each pod's run directory is its own, and new with each pod. Every pod of the job, and a pod made
    again after a failure, gets the same id from what they share; a job saving to another checkpoint folder another."""
    from launcher.run_id import claim_run

    def run_id(pod: str, checkpoints: str = "s3://bucket/run") -> str:
        frozen = OmegaConf.create(
            {"job": {"config_hash": "0" * 16}, "trainer": {"checkpoint_dir": checkpoints},
             "derived": {"shared_run_dir": False}}
        )  # fmt: skip
        claim_run(frozen, tmp_path / pod, None, "k8s-master-29500").release()
        return frozen.job.run_id

    assert run_id("pod-0") == run_id("pod-1") == run_id("pod-0-again") != run_id("other", "s3://bucket/other")
    assert not list(tmp_path.glob("*/run_id"))


@pytest.mark.unit
def test_a_manifest_records_its_run_id_checked_and_older_ones_without_it_load(tmp_path: Path) -> None:
    from launcher.checkpoint.format import read_manifest
    from launcher.checkpoint.untrusted import UntrustedDataError

    base = {
        "step": 3,
        "samples": 96,
        "world_size": 2,
        "time": 1.0,
        "config_hash": "0" * 16,
        "files": {},
        "xxh3_128": {},
    }
    for run_id in ("k3x9a0qz", None, "absent"):
        manifest = base if run_id == "absent" else {**base, "run_id": run_id}
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        assert read_manifest(tmp_path).get("run_id") == (None if run_id == "absent" else run_id)
    for bad in (7, "", "a/b", "x" * 65, ["k3x9a0qz"]):
        (tmp_path / "manifest.json").write_text(json.dumps({**base, "run_id": bad}))
        with pytest.raises(UntrustedDataError, match="has a bad 'run_id'"):
            read_manifest(tmp_path)


@pytest.mark.unit
def test_the_last_logged_step_is_the_highest_in_metrics_jsonl_not_its_last(tmp_path: Path) -> None:
    """Attempts append from the step they resumed at: 1..9, then 7..8 (killed before it passed 9), then a line torn
    by a kill. The next attempt must not log 9 again."""
    from launcher.logs import JsonlLogger, last_logged_step

    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) == 0
    jsonl = JsonlLogger(path)
    for step in [*range(1, 10), 7, 8]:
        jsonl.log({"loss": 1.0}, step)
    jsonl.finish()
    with open(path, "a") as f:
        f.write('{"step": 10, "time": 1.0, "lo')
    assert last_logged_step(path) == 9
