"""A worker's life beyond the training loop: stop signals, an orphan watchdog, and what each rank is doing.

- Stop signals (SIGTERM, SIGINT, SIGUSR2 — which SLURM sends before a time-limit kill — and SIGHUP):
  the first asks for a graceful stop (finish the optimizer step, checkpoint, exit). SLURM signals every
  process of a step at once and the elastic agent forwards the signal again, so repeats within
  `STOP_REPEAT_GRACE` seconds are the same request; only a signal well after the first exits at once.
- A worker ends itself when its launcher is gone (killed with SIGKILL), from its first instruction
  (`die_with_parent`: the kernel's parent-death signal) and by a watchdog thread, so no worker is
  ever left behind.
- `Phase` writes what this rank is doing to a small file, so that a collective that times out can
  name the rank that is stuck and what it was doing, not only "timed out".
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)
EXIT_STOPPED = 3
"""A worker that stopped on a signal after saving: not a success (the run is not finished), not a crash."""
STOP_REPEAT_GRACE = 5.0
"""Seconds after the first stop signal during which another is the same request (SLURM and the agent both send)."""


class StopRequest:
    """Set by the first stop signal; the runner checks it once per optimizer step."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.at = 0.0

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()
        elif time.monotonic() - self.at > STOP_REPEAT_GRACE:
            os._exit(128 + signum)  # asked again, well after the first: stop now, without saving


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
    """What this rank is doing now, in `<run dir>/logs/phase/rank<N>` (one line: time, then the phase)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.dir = run_dir / "logs" / "phase"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path, self.rank, self.now = self.dir / f"rank{rank}", rank, "starting"

    def __call__(self, what: str) -> None:
        self.now = what
        self.path.write_text(f"{time.time():.3f} {what}")

    def others(self) -> str:
        """The other ranks' last phases, oldest first: the stuck rank leads."""
        seen = []
        for path in self.dir.glob("rank*"):
            if path != self.path:
                stamp, _, what = path.read_text().partition(" ")
                seen.append(
                    (
                        float(stamp),
                        f"{path.name.replace('rank', 'rank ')} was last {what} "
                        f"({time.time() - float(stamp):.0f} s ago)",
                    )
                )
        return "; ".join(text for _, text in sorted(seen)) or "no other rank reported"


def report_failure(error: BaseException, rank: int, run_dir: Path) -> NoReturn:
    """A worker's exception, told once: its whole traceback into `<run dir>/logs/rank<N>.traceback`, one line (where
    in the run, the exception, the traceback's path) into the error file torch's elastic agent reads, from which the
    launcher prints one line per failing rank. Nothing on the terminal; exit 1."""
    phase = getattr(error, "launch_phase", None) or "starting"
    log = run_dir / "logs" / f"rank{rank}.traceback"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    except OSError:
        log = Path("(not written)")
    message = " ".join(str(error).split())[:500]
    line = f"while {phase}: {type(error).__name__}: {message} (traceback: {log})"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        info = {"py_callstack": text, "timestamp": str(int(time.time())), "time": time.time()}
        record = {"message": {"message": line, "extraInfo": info}}
        with open(error_file, "w") as f:
            json.dump(record, f)
    os._exit(1)
