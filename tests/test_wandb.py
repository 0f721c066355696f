"""Real wandb, offline: with no API key the run logs offline by itself, and what it logged reads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY, clean_env, launch
from omegaconf import OmegaConf
from runs import reference
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


def test_logger_none_writes_no_wandb_files(conformance_dir: Path) -> None:
    run = reference(conformance_dir)  # the conformance suite's one-process run, logger=none
    assert len(run.metrics) == 12 and not (run.run_dir / "wandb").exists()
    assert not list(run.run_dir.rglob("*.wandb")), list(run.run_dir.rglob("*.wandb"))
