"""A study in its storage, as the search sweeper drives it: opened (made on the first run), held by one sweeper at a
time, checked to be the study this command describes, and continued after a kill without repeating a finished trial.

The storage is a SQLite file in the sweep directory (`study.db`) unless `hydra.sweeper.storage` names Optuna's journal
or a database URL (`launcher.search.claims`: several sweepers on one study). For a SQLite study, a lock on
`<sweep dir>/.study.lock`, held while its one sweeper runs (the kernel drops it when the process dies), makes every
trial still marked RUNNING an orphan of a sweeper that is gone: the next run of the same command continues it first,
in its own folder, from its last checkpoint.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Any

DB = "study.db"
LOCK = ".study.lock"
SWEEP_DIR = "sweep_dir"
"""A trial's user attribute: the sweep directory whose sweeper runs it (its run is `<sweep dir>/<trial number>`)."""
DEFINITION = "definition"
"""The study's user attribute: what this command searched (distributions, fixed overrides, objective)."""


class StudyError(ValueError):
    """A study this command cannot run: one line naming it and the fix."""


def storage_url(given: str | None, sweep_dir: Path) -> str:
    return given or f"sqlite:///{(sweep_dir / DB).absolute()}"


def hold(sweep_dir: Path) -> IO[str]:
    """The sweep directory's study lock, held until the process ends; StudyError if another sweeper holds it."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    lock = open(sweep_dir / LOCK, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise StudyError(
            f"the study in hydra.sweep.dir={sweep_dir} is being run by another launch; wait for it to end, or choose "
            "another hydra.sweep.dir (a SQLite study has one sweeper: several share a study on "
            "hydra.sweeper.storage=journal or a database URL)"
        ) from None
    os.register_at_fork(after_in_child=lock.close)  # a worker forked from here does not hold it
    return lock


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file."""


def check_file(url: str) -> None:
    """A study's SQLite file, when it is there, read as data before optuna opens it (which would add its tables to any
    database, and gives a traceback for a file that is none): StudyError naming the file and what it is, the file
    left as it is."""
    if not url.startswith("sqlite:///"):
        return
    import sqlite3

    path = Path(url.removeprefix("sqlite:///"))
    fix = f"move it away to start a new study there, or choose another hydra.sweep.dir; {path.name} is left as it is"
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return
    except OSError as e:
        raise StudyError(f"{path} cannot be read ({e.strerror}); make it readable, or {fix}") from None
    if not head:
        return  # an empty file: SQLite's empty database
    if head != SQLITE_HEADER:
        raise StudyError(f"{path} is not a SQLite database (it begins {head[:12]!r}), so no study; {fix}")
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)  # read-only: nothing written to it
        try:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.Error as e:
        raise StudyError(f"{path} is a damaged SQLite database ({e}); {fix}") from None
    if tables and "studies" not in tables:
        shown = ", ".join(sorted(tables)[:5])
        raise StudyError(f"{path} is a SQLite database of something else (its tables: {shown}), not a study; {fix}")


def open_study(
    name: str, url: str, direction: str | list[str], sampler: Any, pruner: Any, definition: list[str]
) -> Any:
    """The study `name` in `url` (a storage spec, `launcher.search.claims.spec`), made if new; StudyError if it exists
    and searched something else, or if `url` holds no study optuna can read. Lines name the URL masked."""
    import optuna

    from launcher.base.storage import masked
    from launcher.config import one_line

    check_file(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fix = "check hydra.sweeper.storage (its password from PGPASSWORD or ~/.pgpass), or choose another hydra.sweep.dir"
    try:
        study = optuna.create_study(
            study_name=name,
            storage=storage(url),
            direction=direction if isinstance(direction, str) else None,
            directions=direction if isinstance(direction, list) else None,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
    except ImportError as e:  # the database's driver (SQLAlchemy's dialect names it)
        raise StudyError(
            f"the study storage {masked(url)} cannot be opened: its database driver is not installed "
            f"({masked(one_line(e.__cause__ or e))[:200]}); pip install 'launch[postgres]' for PostgreSQL (psycopg: "
            "postgresql://...), or install the driver the URL names"
        ) from None
    except Exception as e:  # the database's own error (SQLAlchemy's), or the journal's file: one line, no traceback
        if not type(e).__module__.startswith(("sqlalchemy", "optuna")) and not isinstance(e, OSError):
            raise
        raise StudyError(
            f"the study storage {masked(url)} cannot be opened ({type(e).__name__}: {masked(one_line(e))[:300]}); {fix}"
        ) from None
    before = study.user_attrs.get(DEFINITION)
    if before is None:
        study.set_user_attr(DEFINITION, definition)
    elif before != definition:
        was, now = sorted(set(before) - set(definition)), sorted(set(definition) - set(before))
        raise StudyError(
            f"study {name!r} in {masked(url)} searched {'; '.join(was) or 'less'}, this command "
            f"{'; '.join(now) or 'less'}: continue it with its own overrides, or start another with "
            "hydra.sweeper.study_name=... (or another hydra.sweep.dir)"
        )
    return study


def finished(study: Any) -> int:
    """Trials that count against the budget: complete, pruned or failed."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


def ended(run_dir: Path) -> dict[str, Any] | None:
    """An orphan's outcome, when its run had ended before the kill reached the study (`outcome.json`, read as data):
    told as it is, not run again."""
    import json
    import math

    try:
        record = json.loads((run_dir / "outcome.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("state") not in ("complete", "pruned", "failed"):
        return None
    values = record.get("objective")
    values = values if isinstance(values, list) else [values]  # several objectives: a value each
    if record["state"] == "complete" and not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return record


def resumed(study: Any, frozen: Any) -> Any:
    """A trial object for a RUNNING trial of an earlier run of this sweep, to report to and tell."""
    import optuna

    return optuna.trial.Trial(study, frozen._trial_id)


def tell(study: Any, trial: Any, record: dict[str, Any]) -> tuple[str, bool]:
    """Tell the study what the trial's run came to (`launcher.search.objective.trial_outcome`): its state's name, and
    whether the sampler has nothing left to try (a grid or brute-force sampler that has tried every point)."""
    from optuna.trial import TrialState

    from launcher.adapters.optuna_private import stop_allowed

    state = str(record.get("state"))
    if state not in ("complete", "pruned"):
        trial.set_user_attr("reason", str(record.get("reason", ""))[:500])
        state = "failed"
    # Samplers that run out of points call `Study.stop()`, which optuna accepts only inside `optimize`: here the
    # sweeper's loop is that loop, and it reads whether one did.
    with stop_allowed(study) as stopped:
        if state == "complete":
            study.tell(trial, record["objective"])
        else:
            study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
    return state, stopped()


def storage(spelled: str) -> Any:
    """What optuna opens for a spec: a JournalStorage on its file, or the database URL as it is."""
    if not spelled.startswith("journal:"):
        return spelled
    import optuna
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(spelled.removeprefix("journal:")))


def parallel(spelled: str) -> bool:
    """Several sweepers may share the study: a journal or a database server, not a SQLite file."""
    return not spelled.startswith("sqlite:")
