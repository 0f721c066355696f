"""MLflow from rank 0 (`logger=mlflow`): one MLflow run per job, continued by every attempt of the job.

Where: `logger.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite store in the run directory (a sweep's job:
in the sweep directory, so that its jobs share one store), `<dir>/mlflow/mlflow.db`, its artifacts beside it: no
server needed. The run's MLflow id is kept in `<run dir>/mlflow_run_id`, beside the job's `run_id`, and tagged
`launch.run_id` on the run: an elastic restart, a resize, a requeue and `resume=` of the run directory continue it (and
nodes that share no run directory find it by that tag). The steps an earlier attempt logged past the checkpoint this
one resumed from are not logged again (MLflow keeps every point it is given). A sweep's job runs are nested under
one parent run per sweep, which gets the sweep's report at its end (`finish_sweep`).

What a run holds: the resolved config as flattened params (`trainer.max_steps`), every figure metrics.jsonl gets as
a metric at its step, `resolved.yaml` as an artifact, and its status at the end: FINISHED, FAILED or KILLED (a stop
signal). mlflow is imported by rank 0 only; the launcher's check imports it only to ask a server whether it answers.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from launcher.base.settings import Settings
from launcher.loggers import mlflow_store as store
from launcher.loggers.base import last_logged_step
from launcher.loggers.checks import can_make, installed

RUN_ID_FILE = "mlflow_run_id"
"""`<run dir>/mlflow_run_id`: the MLflow run of the job (one line)."""
RUN_ID = re.compile(r"[0-9a-f]{32}")
"""What MLflow's run ids look like; anything else in `mlflow_run_id` is refused."""
PARAM_VALUE_LIMIT = 6000
"""MLflow's longest param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH); longer ones are cut, and said so."""
PARAMS_PER_CALL = 100
"""MLflow's most params in one log_batch call."""
NAME = re.compile(r"[^/\w.\- :]")
"""A character MLflow refuses in a param's name."""
EXTRA = "pip install 'launch[mlflow]'"


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """The resolved config as MLflow params: one per leaf, named by its dotted path (`trainer.max_steps`), a string
    (strings as they are, other values as JSON: `true`, `null`, `[1, 2]`)."""
    if isinstance(node, dict):
        if not node and prefix:
            return {prefix: "{}"}
        params: dict[str, str] = {}
        for key, value in node.items():
            params |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return params
    value = node if isinstance(node, str) else json.dumps(node, default=str)
    return {NAME.sub("_", prefix)[:250]: value}


class MlflowLogger:
    """One MLflow run per job (see the module's docstring)."""

    @staticmethod
    def check(**keys: Any) -> None:
        """What MLflow would refuse once the run starts, checked before: its package, the settings, a tracking server
        that answers within `mlflow_store.CHECK_TIMEOUT` seconds, a SQLite store's folder. ImportError, ValueError or
        ConnectionError (one line, credentials hidden). `keys`: logger.mlflow's (launcher/config/schema.py:
        `MlflowConfig`, their one place)."""
        mlflow = Settings(**keys)
        tracking_uri, experiment = mlflow.tracking_uri, mlflow.experiment
        if not installed("mlflow"):
            raise ImportError(f"logger=mlflow needs the mlflow package, which is not installed: {EXTRA}")
        if tracking_uri and (urlsplit(tracking_uri).username or urlsplit(tracking_uri).password):
            raise ValueError(
                f"logger.mlflow.tracking_uri={store.redact(tracking_uri)} carries credentials: give them in "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), never the config"
            )
        if not str(experiment).strip():
            raise ValueError("logger.mlflow.experiment is empty: name the experiment the run goes into")
        for key, value in (mlflow.tags or {}).items():
            if NAME.search(str(key)) or not 0 < len(str(key)) <= 250 or len(str(value)) > 8000:
                raise ValueError(
                    f"logger.mlflow.tags holds {str(key)!r}: MLflow tag names are 1-250 letters, digits and / _ . - : "
                    "or spaces, their values up to 8000 characters"
                )
        uri = store.configured_uri(tracking_uri)
        if uri is None:
            return  # the local store, in the run directory the launcher checks it can write
        database = store.sqlite_file(uri)
        if database is not None:
            if not can_make(database.parent):
                raise ValueError(
                    f"the MLflow store {uri} cannot be made: {database.parent} cannot be made or written by this user; "
                    "choose another logger.mlflow.tracking_uri (or MLFLOW_TRACKING_URI)"
                )
            return  # a local database: made by the run, not here (a new store's migrations take seconds)
        store.reach(uri, str(experiment))

    def __init__(self, run_config: dict[str, Any], run_dir: str, **keys: Any) -> None:
        """`keys`: logger.mlflow's (launcher/config/schema.py: `MlflowConfig`)."""
        from mlflow.tracking import MlflowClient  # heavy: only rank 0 of a run that asked for MLflow pays for it

        store.quiet()
        settings = Settings(**keys)
        tracking_uri, experiment = settings.tracking_uri, settings.experiment
        job = run_config.get("job") or {}
        sweep_dir = job.get("sweep_dir")
        self.run_dir = Path(run_dir)
        self.uri = store.configured_uri(tracking_uri) or store.local_store(
            Path(sweep_dir) if sweep_dir else self.run_dir
        )
        # A sweep's jobs may start at once: one makes the store, the experiment and the parent run.
        with store.lock(sweep_dir):
            self.client = MlflowClient(self.uri)
            experiment_id = store.experiment(self.client, str(experiment), self.uri)
            parent = store.parent_run(self.client, experiment_id, settings.group, sweep_dir) if settings.group else None
        self.run_id, continued = self._open(experiment_id, job, settings.name, dict(settings.tags or {}), parent)
        # One step axis: the steps an earlier attempt logged (past the checkpoint this one resumed from) are not
        # logged again; MLflow would keep both.
        self.logged = self._logged_before() if continued else 0
        self.said, self.lost, self.failing = False, [], False
        self._log_config(run_config, continued)
        chosen = store.configured_uri(tracking_uri)
        where = f"at {store.redact(self.uri)}" if chosen else f"in {store.sqlite_file(self.uri)}"
        view = "" if chosen else f" (view: mlflow ui --backend-store-uri {self.uri})"
        verb = "continuing" if continued else "logging to"
        store.say(f"{verb} run {self.run_id} of experiment '{experiment}' {where}{view}")

    def _open(
        self, experiment_id: str, job: dict[str, Any], name: str | None, tags: dict[str, str], parent: str | None
    ) -> tuple[str, bool]:
        """The job's run: the one `mlflow_run_id` names, else the one tagged with the job's run id (a node whose run
        directory is new), made RUNNING again; else a new one, its id written to `mlflow_run_id`. (id, continued)"""
        from mlflow.exceptions import MlflowException

        file = self.run_dir / RUN_ID_FILE
        known = _read_run_id(file)
        launch_id = job.get("run_id")
        if known is None and launch_id:
            found = self.client.search_runs(
                [experiment_id], filter_string=f"tags.`launch.run_id` = '{launch_id}'", max_results=1
            )
            known = found[0].info.run_id if found else None
        if known is not None:
            try:
                run = self.client.get_run(known)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":  # the store itself failed: a fault, not a new run
                    raise
                run = None
                store.say(f"run {known} ({file}) is not in {store.redact(self.uri)}: logging to a new run")
            if run is not None and run.info.lifecycle_stage == "deleted":
                store.say(f"run {known} ({file}) was deleted: logging to a new run")
                run = None
            if run is not None:
                self.client.update_run(known, status="RUNNING")
                _write_run_id(file, known)
                return known, True
        tags = {**tags, "launch.run_dir": str(self.run_dir.absolute())}
        if launch_id:
            tags["launch.run_id"] = str(launch_id)
        if job.get("continues"):  # resume= into a new run directory: a new run that names the one it continues
            tags["launch.continues"] = str(job["continues"])
            tags["mlflow.note.content"] = f"continues run {job['continues']} (launch.run_id)"
        if parent:
            tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(experiment_id, run_name=name or self.run_dir.name, tags=tags)
        _write_run_id(file, run.info.run_id)
        return run.info.run_id, False

    def _logged_before(self) -> int:
        """The highest step the run holds: metrics.jsonl's, or MLflow's own where it holds more (a node whose run
        directory is new)."""
        steps = [m.step for m in self.client.get_run(self.run_id).data.to_proto().metrics]
        return max([last_logged_step(self.run_dir / "metrics.jsonl"), *steps])

    def _log_config(self, run_config: dict[str, Any], continued: bool) -> None:
        """The config as params (a continued run keeps those its first attempt logged: MLflow refuses to change
        one), and as `resolved.yaml`, this attempt's, an artifact."""
        import yaml
        from mlflow.entities import Param

        params = flatten(run_config)
        cut = sorted(k for k, v in params.items() if len(v) > PARAM_VALUE_LIMIT)
        params = {k: v[: PARAM_VALUE_LIMIT - 1] + "…" if k in cut else v for k, v in params.items()}
        if cut:
            store.say(
                f"params {', '.join(cut)} are longer than MLflow keeps ({PARAM_VALUE_LIMIT} characters): cut; "
                "resolved.yaml, an artifact of the run, holds them whole"
            )
        if continued:
            kept = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k, v in params.items() if k in kept and kept[k] != v)
            params = {k: v for k, v in params.items() if k not in kept}
            if changed:
                shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
                store.say(
                    f"run {self.run_id} keeps the params of its first attempt; this attempt's differ in {shown} "
                    "(resolved.yaml, an artifact of the run, is this attempt's)"
                )
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[start : start + PARAMS_PER_CALL])
        self.client.log_text(self.run_id, yaml.safe_dump(run_config, sort_keys=False), "resolved.yaml")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged:
            if not self.said:
                self.said = True
                steps = f"step {step} is" if step == self.logged else f"steps {step}..{self.logged} are"
                store.say(
                    f"{steps} in run {self.run_id} already (an earlier attempt logged them): logging from step "
                    f"{self.logged + 1} on"
                )
            return
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items() if value is not None]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as e:  # the server gone for a while: training goes on, metrics.jsonl keeps every step
            if not self.failing:  # once an outage
                store.say(
                    f"step {step} could not be logged to {store.redact(self.uri)} ({store.reason(e)}); "
                    "the run goes on, metrics.jsonl holds every step"
                )
            self.failing = True
            self.lost.append(step)
            return
        if self.failing:
            self.failing = False
            store.say(f"logging to run {self.run_id} again from step {step}")

    def finish(self, status: str = "FINISHED") -> None:
        if self.lost:
            store.say(
                f"{len(self.lost)} logged step(s) did not reach run {self.run_id} (the first: step {self.lost[0]}); "
                "metrics.jsonl holds them"
            )
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # the run trained to its end: a store gone at the last moment does not fail it
            store.say(f"run {self.run_id} could not be marked {status} at {store.redact(self.uri)} ({store.reason(e)})")


def _read_run_id(file: Path) -> str | None:
    """The MLflow run id in `file`, None when there is none; ValueError (one line) when it holds something else:
    never replaced, since a new run would split the job's history silently."""
    try:
        value = file.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    if not RUN_ID.fullmatch(value):
        raise ValueError(
            f"{file} holds {value[:80]!r}, not an MLflow run id (32 hex digits): delete it to start a new MLflow run "
            "for this run directory, or write into it the id of the run to continue"
        )
    return value


def _write_run_id(file: Path, run_id: str) -> None:
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    tmp.write_text(f"{run_id}\n")
    os.replace(tmp, file)
