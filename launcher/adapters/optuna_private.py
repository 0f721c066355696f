"""Every name of optuna's that the launcher relies on beyond optuna's public API, checked against optuna 5.1.0.

A sampler that has tried every point (a grid, a brute-force search) calls `Study.stop()`, which optuna accepts only
inside `Study.optimize`; the search sweeper asks and tells trials itself, so its loop is that loop: while it tells a
trial the study is marked as inside it, and the flag `stop()` sets is read back (`stop_allowed`). Both are the
study's private attributes (`_thread_local.in_optimize_loop`, `_stop_flag`), checked before use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from strategies.checked import Private, changed, check

CHECKED_AGAINST = "5.1.0"
ADAPTER = "launcher/adapters/optuna_private.py"
NAMES = (Private("optuna.study.study:Study.stop", ("self",)),)
STATE = ("_thread_local.in_optimize_loop", "_stop_flag")
"""What `Study.stop()` reads and sets on the study."""


def check_study(study: Any, where: Any = None) -> None:
    """LibraryChanged, in one line, where `study` (an optuna Study) lacks what `stop_allowed` sets and reads."""
    check("optuna", CHECKED_AGAINST, NAMES, ADAPTER, where)
    for path in STATE:
        found: Any = study
        try:
            for name in path.split("."):
                found = getattr(found, name)
        except AttributeError:
            raise changed("optuna", CHECKED_AGAINST, f"optuna.study.study:Study.{path}", "is gone", ADAPTER) from None


@contextmanager
def stop_allowed(study: Any) -> Iterator[Callable[[], bool]]:
    """Inside the block a sampler may call `study.stop()` (as inside `Study.optimize`); the function it gives says
    whether one did."""
    check_study(study)
    study._thread_local.in_optimize_loop, study._stop_flag = True, False
    try:
        yield lambda: bool(study._stop_flag)
    finally:
        study._thread_local.in_optimize_loop = False
