"""The MLflow tracking store a run logs to: which one (the user's URI, else a SQLite store in the run or sweep
directory), whether it answers (the launcher's check: one try, CHECK_TIMEOUT seconds), why it does not when it fails
(an outage's reason in a few words, credentials hidden), and what a run is filed under in it (its experiment, a
sweep's parent run, which gets the sweep's report at the end). The run itself is
`launcher.loggers.mlflow.MlflowLogger`'s."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STORE = "mlflow"
"""The local store's folder: `<run or sweep dir>/mlflow/mlflow.db`, artifacts in `mlflow/mlartifacts/`."""
CHECK_TIMEOUT = 5
"""Seconds the launcher's check waits for a tracking server's answer (one try) before it says it cannot be reached."""


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it hidden (`http://user:secret@host` -> `http://***@host`)."""
    return re.sub(r"(\w+://)[^/\s@]+@", r"\1***@", text)


def say(line: str) -> None:
    print(f"mlflow: {line}", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return redact(lines[0] if lines else type(e).__name__)[:300]


def reason(e: BaseException, timeout: float | None = None) -> str:
    """Why MLflow's client could not use a store, in a few words: the network's error (a refused connection, a name
    that does not resolve, no answer within `timeout` seconds), the server's HTTP status, else MLflow's first line."""
    text = str(e)
    if "timed out" in text.lower():
        return "no answer" + (f" within {timeout:g} s" if timeout else " in time")
    if found := re.search(r"\[Errno -?\d+\] ([^'\")]+)", text):
        return found.group(1).strip()
    if found := re.search(r"error code (\d+) != 200", text):
        return f"HTTP {found.group(1)}"
    return _first_line(e)


def configured_uri(tracking_uri: str | None) -> str | None:
    """The tracking URI the user chose: logger.mlflow.tracking_uri, else MLFLOW_TRACKING_URI; None: the local store."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def local_store(folder: Path) -> str:
    """The SQLite URI of the local store in `folder` (a run or sweep directory)."""
    return f"sqlite:///{(folder / STORE / 'mlflow.db').absolute()}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a SQLite URI (`sqlite:///relative` or `sqlite:////absolute`), None for another URI."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def _artifacts_beside(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: beside the database (MLflow's own default is
    `./mlruns` in whatever folder the process runs in); None: the store's or server's own choice."""
    database = sqlite_file(uri)
    return str(database.absolute().parent / "mlartifacts") if database is not None else None


@contextlib.contextmanager
def _http_for_a_check() -> Iterator[None]:
    """MLflow's HTTP calls, for the launcher's check only: one try, CHECK_TIMEOUT seconds (its defaults: 7 retries
    with back-off and 120 s each, minutes before it says a server is not there)."""
    from launcher.base.environ import environ

    with environ({"MLFLOW_HTTP_REQUEST_TIMEOUT": str(CHECK_TIMEOUT), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}):
        yield


def quiet() -> None:
    """MLflow's and alembic's INFO lines (a new store's migrations) stay out of rank 0's output."""
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def reach(uri: str, experiment: str) -> None:
    """ConnectionError (one line naming the URI, credentials hidden) when MLflow's client cannot use the tracking
    store at `uri`: no answer within CHECK_TIMEOUT seconds, a refusal (credentials, permissions), a URI it does not
    take."""
    with _http_for_a_check():
        try:
            from mlflow.tracking import MlflowClient

            quiet()
            MlflowClient(uri).get_experiment_by_name(experiment)
        except Exception as e:
            raise ConnectionError(
                f"logger=mlflow: the tracking store {redact(uri)} cannot be used ({reason(e, CHECK_TIMEOUT)}); start "
                "it or fix logger.mlflow.tracking_uri (or MLFLOW_TRACKING_URI), or unset both to log into a SQLite "
                "store in the run directory"
            ) from None


@contextlib.contextmanager
def lock(sweep_dir: str | None) -> Iterator[None]:
    """Held by a sweep's job while it opens the sweep's store (the first makes its tables), experiment and parent run;
    nothing to hold for a single run."""
    if not sweep_dir:
        yield
        return
    import fcntl

    with open(Path(sweep_dir) / ".mlflow.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def experiment(client: Any, name: str, uri: str) -> str:
    """The experiment's id, made where it is not there (its artifacts beside a SQLite store)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, artifact_location=_artifacts_beside(uri))
        except MlflowException:  # made meanwhile by another job
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise ValueError(
            f"MLflow experiment '{name}' at {redact(uri)} is deleted; restore it (mlflow experiments restore "
            f"--experiment-id {found.experiment_id}) or choose another logger.mlflow.experiment"
        )
    return str(found.experiment_id)


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def find_parent(client: Any, experiment_id: str, group: str, sweep_dir: str | None) -> Any:
    """The parent run of `group` (in a sweep: of that sweep directory), or None."""
    where = f"tags.`launch.group` = {_quoted(group)} and tags.`launch.sweep_dir` = {_quoted(sweep_dir or '')}"
    found = client.search_runs([experiment_id], filter_string=where, max_results=1)
    return found[0] if found else None


def parent_run(client: Any, experiment_id: str, group: str, sweep_dir: str | None) -> str:
    """The run the job's run is nested under: one per group (a sweep), made by its first job, RUNNING while jobs run."""
    parent = find_parent(client, experiment_id, group, sweep_dir)
    if parent is None:
        tags = {"launch.group": group, "launch.sweep_dir": sweep_dir or ""}
        return str(client.create_run(experiment_id, run_name=group, tags=tags).info.run_id)
    if parent.info.status != "RUNNING":  # a sweep that goes on (a search continued)
        client.update_run(parent.info.run_id, status="RUNNING")
    return str(parent.info.run_id)


def finish_sweep(sweep_dir: Path, status: str, files: list[Path]) -> str | None:
    """At the end of a sweep whose jobs logged to MLflow: its parent run gets `files` (the report and its chart) as
    artifacts and its status. Returns the parent's id, None when the sweep has none (its jobs logged elsewhere)."""
    import yaml

    for resolved in sorted(sweep_dir.glob("*/resolved.yaml")):
        cfg = yaml.safe_load(resolved.read_text()) or {}
        settings = (cfg.get("logger") or {}).get("mlflow")
        if isinstance(settings, dict) and settings.get("group"):
            break
    else:
        return None
    from mlflow.tracking import MlflowClient

    quiet()
    uri = configured_uri(settings.get("tracking_uri")) or local_store(sweep_dir)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(str(settings["experiment"]))
    job = cfg.get("job") or {}
    parent = experiment and find_parent(client, experiment.experiment_id, settings["group"], job.get("sweep_dir"))
    if not parent:
        return None
    for file in files:
        if file.exists():
            client.log_artifact(parent.info.run_id, str(file))
    client.set_terminated(parent.info.run_id, status=status)
    return str(parent.info.run_id)
