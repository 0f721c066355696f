"""A worker's life beyond the training loop: stop signals, an orphan watchdog, and what each rank is doing.

- Stop signals (SIGTERM, SIGINT, SIGUSR2 — which SLURM sends before a time-limit kill — and SIGHUP):
  the first asks for a graceful stop (finish the optimizer step, checkpoint, exit). SLURM signals every
  process of a step at once and the elastic agent forwards the signal again, so repeats within
  `STOP_REPEAT_GRACE` seconds are the same request; only a signal well after the first exits at once.
- A worker ends itself when its launcher is gone (killed with SIGKILL), from its first instruction
  (`die_with_parent`: the kernel's parent-death signal) and by a watchdog thread, so no worker is
  ever left behind.
- `Phase` keeps what this rank is doing in memory and writes it to a small file only when someone may need it (at
  most every `PHASE_FLUSH_EVERY` seconds, on a stop signal, on SIGUSR1, before a timeout is reported), so that a
  collective that times out can name the rank that is stuck and what it was doing, not only "timed out", without
  every rank touching a shared file system on every micro-step.
- SIGUSR1 (which the launcher forwards to its workers) writes each rank's phase and its Python stacks, every
  thread's, with `faulthandler` (from C: a rank stuck inside a collective still answers).
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

from launcher.base.errors import REFUSED, Refused
from launcher.base.process import DUMP_SIGNAL, STOP_REPEAT_GRACE, STOP_SIGNALS
from launcher.base.run_files import FAILED_FLAG, FAILURE_DIR_ENV, NODE_ID_ENV, WAITING, host_of

EXIT_STOPPED = 3
"""A worker that stopped on a signal after saving: not a success (the run is not finished), not a crash."""
PHASE_FLUSH_EVERY = 2.0
"""Seconds between two writes of a rank's phase file, at most (and only when the phase changed)."""


class StopRequest:
    """Set by the first stop signal; the runner checks it once per optimizer step."""

    def __init__(self, on_signal: Callable[[], None] = lambda: None) -> None:
        self.signal: int | None = None
        self.at = 0.0
        self.on_signal = on_signal
        """Called on each stop signal, from the handler (so it must neither block nor raise): the worker writes its
        phase (where it was when asked to stop)."""

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.on_signal()
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()
        elif time.monotonic() - self.at > STOP_REPEAT_GRACE:
            os._exit(128 + signum)  # asked again, well after the first: stop now, without saving


def after_fork() -> None:
    """In a worker forked from the launcher: what the launcher had set up for itself, undone, so that the worker is
    the process `python -u -m launcher.worker.main` would be. Its exit handlers are not the worker's; its log handlers
    (Hydra's console and launch.log, the agent's agent.log) neither; its OpenMP threads were sized before
    `OMP_NUM_THREADS` was chosen for the workers; and a worker's output is unbuffered."""
    import atexit
    import io
    import logging

    getattr(atexit, "_clear", lambda: None)()
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if logger is logging.getLogger() or getattr(handler, "launch_run_log", False):
                logger.removeHandler(handler)  # not closed: the launcher's file objects, shared with it
                logger.propagate = True
    logging.getLogger().setLevel(logging.WARNING)
    if threads := os.environ.get("OMP_NUM_THREADS", "").strip():
        import torch

        torch.set_num_threads(int(threads))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        setattr(
            sys,
            name,
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), stream.encoding, stream.errors, write_through=True),
        )


def name_process(rank: int) -> None:
    """`launch-rank<N>` in ps, top and /proc/<pid>/comm (what the launcher and a watching operator find a rank by;
    Linux keeps 15 characters)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, f"launch-rank{rank}".encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # not Linux
        pass


def die_with_parent() -> None:
    """From the first instruction of a worker: the kernel kills it when its launcher dies (Linux PR_SET_PDEATHSIG),
    and it ends at once if the launcher is already gone (`LAUNCH_PARENT_PID`, set by the launcher)."""
    expected = os.environ.get("LAUNCH_PARENT_PID")
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the watchdog thread still applies
        pass
    if expected is not None and os.getppid() != int(expected):
        os._exit(1)  # the launcher died before the signal was armed


def watch_parent(interval: float = 0.5) -> None:
    """End this process when its parent (the launcher's elastic agent) is gone."""
    parent = int(os.environ.get("LAUNCH_PARENT_PID", os.getppid()))

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:  # re-parented: the launcher died without closing us
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class Phase:
    """What this rank is doing now, kept in memory; `<run dir>/logs/phase/rank<N>` (one line: the time the phase
    began, then the phase) is written by a thread at most every `every` seconds when the phase changed (and touched
    when it did not, so that its time says when the rank was last heard from), and by
    `flush` (a stop signal, SIGUSR1, a timeout about to be reported). Setting the phase costs two stores, no I/O."""

    def __init__(self, run_dir: Path, rank: int, every: float = PHASE_FLUSH_EVERY) -> None:
        self.dir = run_dir / "logs" / "phase"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path, self.rank = self.dir / f"rank{rank}", rank
        self.born = time.time()
        self.state = (self.born, "starting")  # one attribute, replaced whole: the thread never reads half of it
        self.writes = 0
        self._written: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._every = every
        threading.Thread(target=self._flush_every, name="phase-writer", daemon=True).start()

    def __call__(self, what: str) -> None:
        self.state = (time.time(), what)

    def renumber(self, rank: int) -> None:
        """This process is rank `rank` now (recovery in place re-formed the group): its phase file is that rank's."""
        with self._lock:
            self.path, self.rank, self._written = self.dir / f"rank{rank}", rank, None

    @property
    def now(self) -> str:
        return self.state[1]

    def flush(self) -> None:
        """Write the phase now, if it changed since the last write."""
        with self._lock:
            self._write()

    def try_flush(self) -> None:
        """`flush` that never blocks or raises: for signal handlers and error paths. A handler can interrupt this
        very thread inside a write (SLURM and the agent send the same signal twice within milliseconds), or find the
        writer thread writing; then the write in progress, or the thread's next one, carries the phase. An error
        path must not hide its own error behind one of this file's."""
        if self._lock.acquire(blocking=False):
            try:
                self._write()
            except OSError:
                pass
            finally:
                self._lock.release()

    def _write(self) -> None:
        state = self.state
        if state == self._written:
            os.utime(self.path)  # alive, still in this phase: the file's time says how fresh it is
            return
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text(f"{state[0]:.3f} {state[1]}")
        os.replace(partial, self.path)  # a reader sees the old line or the new one, never half of one
        self._written, self.writes = state, self.writes + 1

    def _flush_every(self) -> None:
        while True:
            try:
                self.flush()
            except OSError:  # the run directory went away (a test's tmp folder, a failed mount): try again later
                pass
            time.sleep(self._every)

    def gave_up(self, world_size: int, wait: float) -> str:
        """This rank gave up waiting in a collective: its phase says so (written now), and so do those of the other
        ranks that gave up too, within `wait` seconds (less where the rest are silent: a stopped or dead rank, whose
        file its writer no longer touches, never marks it). Those that did not never came to the collective: the ranks
        at fault, named with where each was last, the stalest report first; the rest are counted, not listed (at 32
        nodes a line naming all 31 would say nothing)."""
        self(f"{WAITING} while {self.now}")
        self.try_flush()  # never raises: the timeout is what this rank reports (else the writer's round marks it)
        deadline, others = time.monotonic() + wait, set(range(world_size)) - {self.rank}
        reports: dict[int, tuple[float, str, float]] = {}
        waiting: set[int] = set()
        while True:  # a rank marked stays marked: only the others are read again (thousands of ranks, one file system)
            for rank in others - waiting:
                if (report := self._report(rank)) is not None:
                    reports[rank] = report
                    if report[1].startswith(WAITING):
                        waiting.add(rank)
            silent = {rank for rank, (_, _, heard) in reports.items() if time.time() - heard > 3 * self._every}
            if not others - waiting - silent or time.monotonic() >= deadline:
                break  # the rest are marked, or their writers are silent: stopped or gone, they will never mark
            time.sleep(0.5)
        absent = sorted(others - waiting, key=lambda rank: reports.get(rank, (0.0, "", 0.0))[2])
        if not absent:
            return (
                "every other rank gave up waiting too: none is stuck in its own code (a connection between nodes "
                "lost, or a collective that only some ranks call)"
            )
        now, told = time.time(), []
        for rank in absent[:3]:
            host = host_of(self.dir.parent.parent, rank)  # `joined`'s record: where the rank at fault runs
            named = f"rank {rank}{f' (on {host})' if host else ''}"
            if rank not in reports:
                told.append(f"{named} wrote no report")
                continue
            stamp, what, heard = reports[rank]
            told.append(
                f"{named} was last {what} (entered {now - stamp:.0f} s ago; its last report, written every "
                f"{self._every:g} s while it runs, is {now - heard:.0f} s old)"
            )
        more = f"; and {len(absent) - 3} more ranks" if len(absent) > 3 else ""
        also = f"; {len(waiting)} other rank{'s' if len(waiting) != 1 else ''} gave up waiting too" if waiting else ""
        ranks = ", ".join(map(str, sorted(absent)))
        return f"rank{'s' if len(absent) > 1 else ''} {ranks} never came to it: {'; '.join(told)}{more}{also}"

    def _report(self, rank: int) -> tuple[float, str, float] | None:
        """(when its phase began, the phase, when its writer last touched it) from `rank`'s phase file, if written
        in this worker group's life (an earlier attempt's file says nothing of this one)."""
        path = self.dir / f"rank{rank}"
        try:
            stamp, _, what = path.read_text().partition(" ")
            heard = path.stat().st_mtime
            began = float(stamp)
        except (OSError, ValueError):
            return None
        return (began, what, heard) if heard >= self.born else None

    def answer_dump_signal(self) -> None:
        """On SIGUSR1: every thread's Python stack appended to `<run dir>/logs/stacks/rank<N>` (by faulthandler, from
        C, so a rank blocked in a collective answers too), then the phase written (once Python runs again)."""
        stacks = self.dir.parent / "stacks" / f"rank{self.rank}"
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks, "a")  # faulthandler writes to this descriptor: it stays open for the process
        signal.signal(DUMP_SIGNAL, lambda _signum, _frame: self.try_flush())
        faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True, chain=True)
        # A fatal signal (SIGABRT: gloo's abort inside a collective; SIGSEGV) dumps the stacks there too: the launcher
        # names the collective the rank died in (`launcher.elastic.failures.killed_where`).
        faulthandler.enable(file=self._stacks, all_threads=True)


def joined(run_dir: Path, rank: int) -> None:
    """Once the process group is made: `<run dir>/logs/ranks/rank<N>.json` says which node and launcher run this
    rank, so that a node that goes away later can be named by the others (`launcher.elastic.failures.lost_node`)."""
    import socket

    record = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "launcher": os.environ.get(NODE_ID_ENV),
    }
    try:
        folder = run_dir / "logs" / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps(record))
    except OSError:  # a full disk: the run goes on, a lost node is then named less precisely
        pass


def report_failure(error: BaseException, rank: int, run_dir: Path) -> NoReturn:
    """A worker's exception, told once: its whole traceback into `<run dir>/logs/rank<N>.traceback`, one line (where
    in the run, the exception, the traceback's path) into the error file torch's elastic agent reads, from which the
    launcher prints one line per failing rank; where that file cannot be written (`<run dir>/logs/` on a full disk),
    into the launcher's spare folder (`FAILURE_DIR_ENV`), else on stderr: never lost. Exit 1."""
    phase = getattr(error, "launch_phase", None) or "starting"
    log = run_dir / "logs" / f"rank{rank}.traceback"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    except OSError:
        log = Path("(not written)")
    message = " ".join(str(error).split())[:500]
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # a log, a metric: a full disk
        from launcher.base.durable import disk_error

        message = disk_error(error, run_dir)
    line = f"while {phase}: {type(error).__name__}: {message} (traceback: {log})"
    if isinstance(error, Refused):
        line = f"{REFUSED}{message}"
    info = {"py_callstack": text, "timestamp": str(int(time.time())), "time": time.time()}
    record = json.dumps({"message": {"message": line, "extraInfo": info}})
    spare = os.environ.get(FAILURE_DIR_ENV)
    for file in filter(None, [os.environ.get("TORCHELASTIC_ERROR_FILE"), spare and f"{spare}/rank{rank}.json"]):
        try:
            Path(file).write_text(record)
            (run_dir / "logs" / FAILED_FLAG).touch()  # the other nodes' agents look for it (`stop_with_failed_peers`)
            break
        except OSError:  # the run directory's disk is full: the launcher's spare folder, else stderr
            Path(file).unlink(missing_ok=True)  # never half a report
            continue
    else:
        told = line.removeprefix(REFUSED) if line.startswith(REFUSED) else f"rank {rank} failed {line}"
        print(f"launch: error: {told}", file=sys.stderr, flush=True)
    if (logs := sys.modules.get("launcher.loggers.base")) is not None:  # rank 0's loggers, finished as FAILED
        logs.finish_failed()
    os._exit(1)
