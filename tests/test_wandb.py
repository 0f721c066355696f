"""The job's one run id that every logger's run rests on, and logger=none. What wandb logs, offline, is read back in
tests/test_loggers.py, beside MLflow and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Run
from omegaconf import OmegaConf


def test_logger_none_writes_no_logger_files(one_process: Run) -> None:
    run = one_process  # the conformance suite's one-process run, logger=none
    assert len(run.metrics) == 12 and not (run.run_dir / "wandb").exists()
    assert not list(run.run_dir.rglob("*.wandb")), list(run.run_dir.rglob("*.wandb"))
    assert not {"mlflow", "mlflow_run_id", "tensorboard"} & {p.name for p in run.run_dir.iterdir()}


@pytest.mark.unit
def test_the_launchers_of_one_run_directory_agree_on_one_run_id(tmp_path: Path) -> None:
    """Eight launchers (the nodes of one job) prepare one shared run directory at once: the first writes its id,
    the others read it; a later launch reads it too."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from launcher.checkpoint.format import RUN_ID_PATTERN
    from launcher.parent.run_id import make_run_id, read_run_id

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
    from launcher.parent.run_id import claim_run

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
    from launcher.parent.run_id import claim_run

    def run_id(pod: str, checkpoints: str = "s3://bucket/run") -> str:
        frozen = OmegaConf.create(
            {
                "job": {"config_hash": "0" * 16},
                "trainer": {"checkpoint_dir": checkpoints},
                "derived": {"shared_run_dir": False},
            }
        )
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
    from launcher.loggers.base import JsonlLogger, last_logged_step

    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) == 0
    jsonl = JsonlLogger(path)
    for step in [*range(1, 10), 7, 8]:
        jsonl.log({"loss": 1.0}, step)
    jsonl.finish()
    with open(path, "a") as f:
        f.write('{"step": 10, "time": 1.0, "lo')
    assert last_logged_step(path) == 9
