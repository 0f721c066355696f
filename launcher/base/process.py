"""A launcher's or a worker's process: the signals that stop it, and how it ends (`exit_now`), shared by the
launcher (`launcher.parent`) and its workers (`launcher.worker`)."""

from __future__ import annotations

import gc
import os
import signal
import sys
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)


STOP_REPEAT_GRACE = 5.0
"""Seconds after the first stop signal during which another is the same request (SLURM and the agent both send)."""


DUMP_SIGNAL = signal.SIGUSR1
"""Asks every rank for its phase and its Python stacks (`<run dir>/logs/phase/`, `<run dir>/logs/stacks/`)."""


def hold_collector() -> None:
    """A process's start-up is its imports (torch, torch._dynamo, Hydra: about 400k objects that live as long as it):
    the cycle collector, which would scan the whole growing heap again and again meanwhile (a second of a launcher's
    CPU), waits until `release_collector`."""
    gc.disable()


def release_collector() -> None:
    """Once, where `hold_collector` held it: the start-up's objects out of the cycle collector's reach (`gc.freeze`:
    never scanned again, and the pages a forked worker shares with its launcher never written by it), and the
    collector on again for what comes next (a sweep's later jobs, whose garbage it collects)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's own teardown, which frees torch's modules object by object: over a
    second of CPU a process, in the launcher and in every worker, every run. Called once everything that must end
    has ended (the loggers, the strategy, the process group); the exit handlers still run (logging's flush, wandb's
    and torch's clean-ups), then stdio is flushed."""
    run_exit_handlers()
    os._exit(code)


def run_exit_handlers() -> None:
    """What a normal exit runs before the interpreter's teardown: the exit handlers, in the same order, then stdio
    flushed."""
    import atexit

    getattr(atexit, "_run_exitfuncs", lambda: None)()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said
            pass
