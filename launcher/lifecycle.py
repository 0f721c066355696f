"""A worker's life beyond the training loop: stop signals, an orphan watchdog, and what each rank is doing.

- Stop signals (SIGTERM, SIGINT, SIGUSR2 — which SLURM sends before a time-limit kill — and SIGHUP):
  the first asks for a graceful stop (finish the optimizer step, checkpoint, exit); a second
  exits at once.
- The watchdog ends the worker when its launcher is gone (killed with SIGKILL), so no worker is
  ever left behind.
- `Phase` writes what this rank is doing to a small file, so that a collective that times out can
  name the rank that is stuck and what it was doing, not only "timed out".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)
EXIT_STOPPED = 3
"""A worker that stopped on a signal after saving: not a success (the run is not finished), not a crash."""


class StopRequest:
    """Set by the first stop signal; the runner checks it once per optimizer step."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is not None:
            os._exit(128 + signum)  # a second signal: stop now, without saving
        self.signal = signum


def watch_parent(interval: float = 0.5) -> None:
    """End this process when its parent (the launcher's elastic agent) is gone."""
    parent = os.getppid()

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
