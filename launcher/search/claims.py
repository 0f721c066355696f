"""Where a study lives, and which of several sweepers of one study runs which trial.

`hydra.sweeper.storage` is spelled:
- unset: a SQLite file in the sweep directory (`study.db`), for one sweeper at a time;
- `journal`, or `journal:PATH`: Optuna's journal storage, a file in the sweep directory (or PATH) on a shared folder:
  several sweepers, for clusters without a database server;
- a database URL (`postgresql://user@host/db`, the password from PGPASSWORD or ~/.pgpass): several sweepers.

Every sweeper of a study runs in the same sweep directory (a folder every node mounts: the trials' runs and their
checkpoints are there). Which sweeper runs which trial is decided by file locks there, which the kernel (or the file
server) lets go of when their process dies:
- `.study.lock`, held for a moment by the sweeper that picks its next trial (the study's check, its interrupted trials,
  the budget, the next `ask`: one sweeper at a time); a SQLite study's is held for its sweeper's whole life;
- `.trials/<number>.lock`, held by the sweeper that runs that trial, for as long as it runs it.

A RUNNING trial whose lock a sweeper can take has lost its sweeper (a kill, a stop, a requeue): the sweeper that takes
the lock, and only it, continues that trial first, in its own folder, from its last checkpoint.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from launcher.search.study import parallel

JOURNAL = "study.journal"
TRIALS = ".trials"
SWEEP_DIR = "sweep_dir"
"""The study's user attribute: the sweep directory its sweepers run its trials in."""


def spec(given: str | None, sweep_dir: Path) -> str:
    """`hydra.sweeper.storage` as every process of the search reads it (`sweep.storage` of each trial): a database
    URL, or `journal:<file>`."""
    from launcher.search.study import storage_url

    if given == "journal":
        return f"journal:{(sweep_dir / JOURNAL).absolute()}"
    if given and given.startswith("journal:"):
        return f"journal:{Path(given.removeprefix('journal:')).absolute()}"
    return storage_url(given, sweep_dir)


def _lock(path: Path, wait: bool) -> IO[str] | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        f.close()
        return None
    os.register_at_fork(after_in_child=f.close)  # a worker forked from here does not hold it
    return f


class Claims:
    """This sweeper's locks on its study and on the trials it runs."""

    def __init__(self, sweep_dir: Path, spelled: str) -> None:
        from launcher.search.study import hold

        self.sweep_dir, self.whole_life = sweep_dir, not parallel(spelled)
        self.held: dict[int, IO[str]] = {}
        self._life = hold(sweep_dir) if self.whole_life else None

    @contextmanager
    def study(self) -> Iterator[None]:
        """The study to this sweeper alone, for a moment (a SQLite study: already, for its life)."""
        if self.whole_life:
            yield
            return
        lock = _lock(self.sweep_dir / ".study.lock", wait=True)
        assert lock is not None
        try:
            yield
        finally:
            lock.close()

    def take(self, number: int) -> bool:
        """Hold trial `number`'s lock; False when a live sweeper runs it."""
        if number in self.held:
            return False
        lock = _lock(self.sweep_dir / TRIALS / f"{number}.lock", wait=False)
        if lock is not None:
            self.held[number] = lock
        return lock is not None

    def let_go(self, number: int) -> None:
        self.held.pop(number).close()

    def close(self) -> None:
        for number in list(self.held):
            self.let_go(number)
        if self._life is not None:
            self._life.close()


def check_home(study: Any, sweep_dir: Path, shown: str) -> None:
    """The study's sweep directory, recorded by its first sweeper: another one's trials could not go on from each
    other's checkpoints, and their locks would not meet (StudyError). Call inside `Claims.study()`."""
    from launcher.search.study import StudyError

    home = study.user_attrs.get(SWEEP_DIR)
    if home is None:
        study.set_user_attr(SWEEP_DIR, str(sweep_dir))
    elif home != str(sweep_dir):
        raise StudyError(
            f"study {study.study_name!r} in {shown} runs its trials in hydra.sweep.dir={home}, this command in "
            f"{sweep_dir}: every sweeper of a study uses its sweep directory (a folder every node mounts); give "
            f"hydra.sweep.dir={home}, or start another study with hydra.sweeper.study_name=..."
        )


def pick(
    study: Any, claims: Claims, distributions: dict[str, Any], n_trials: int, reseed: Callable[[int], None]
) -> tuple[Any, bool] | None:
    """This sweeper's next trial, held by it: an interrupted one first (True), else a new one while the study has made
    fewer than `n_trials` (False); None when there is none. `reseed(made)` seeds the sampler by the trial's place, so
    that every sweeper draws another point and trial k draws the same one whichever sweeper asks."""
    from optuna.trial import TrialState

    from launcher.search.study import resumed

    with claims.study():
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not claims.take(frozen.number):
                continue  # its sweeper lives
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            now = [t for t in running if t.number == frozen.number]
            if not now:  # told since it was read
                claims.let_go(frozen.number)
                continue
            if set(now[0].params) != set(distributions):  # its sweeper was killed inside `ask`: it never ran
                study.tell(frozen.number, state=TrialState.FAIL)
                claims.let_go(frozen.number)
                continue
            return resumed(study, frozen), True
        made = len(study.get_trials(deepcopy=False))
        if made >= n_trials:
            return None
        reseed(made)
        try:
            trial = study.ask(distributions)
        except ValueError:  # a sampler that cannot sample this space: the trial `ask` made fails, not left running
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if any(t.number == made for t in running):  # under the study's lock, the new trial is number `made`
                study.tell(made, state=TrialState.FAIL)
            raise
        assert claims.take(trial.number), trial.number  # a new trial: no other sweeper can hold it yet
        return trial, False
