"""What the launcher says when workers fail: one line per failing rank, the root cause first, and the kernel's
out-of-memory killer named when it was the one that killed a worker.

A worker that raises writes its own line (`lifecycle.report_failure`: where in the run, the exception, the path of
its traceback) into the error file the elastic agent collects; a worker killed by a signal writes nothing, and then
the launcher looks at the out-of-memory kill counters of its cgroup and of the kernel (`memory.events` or
`memory.oom_control`, and `/proc/vmstat`): a rise during the run means the kernel killed it for memory.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.machine import memory_cgroups


def _cgroup_files() -> list[Path]:
    """This process's memory cgroup counters: v2 `memory.events`, or v1 `memory.oom_control`."""
    return [f for d in memory_cgroups() for f in (d / "memory.events", d / "memory.oom_control") if f.is_file()]


def oom_kills() -> int:
    """Out-of-memory kills so far, counted by this process's cgroup and by the kernel as a whole."""
    total = 0
    for file in [*_cgroup_files(), Path("/proc/vmstat")]:
        try:
            match = re.search(r"^oom_kill (\d+)$", file.read_text(), re.M)
        except OSError:
            continue
        total += int(match.group(1)) if match else 0
    return total


def rank_lines(error: Any, oom_before: int, advice: Callable[[], str] = str) -> list[str]:
    """One line per failing rank of a ChildFailedError, the first failure first; `advice` (what would fit in
    memory) is asked for only when the out-of-memory killer is named."""
    ranks = sorted(error.failures, key=lambda r: _order(r, error.failures[r]))
    oom = oom_kills() > oom_before
    lines, told = [], set()
    for rank in ranks:
        line = _line(rank, error.failures[rank], oom)
        said = re.sub(r"^rank \d+ |\(traceback: [^)]*\)$", "", line) if "(traceback: " in line else line
        if said not in told:  # the same error raised on every rank (a step that was not finite) is said once
            lines.append(line)
            told.add(said)
    if any(OOM in line for line in lines):
        note = advice()
        lines = [f"{line}: {note}" if OOM in line and note else line for line in lines]
    return lines


OOM = "was killed by the out-of-memory killer"


SECONDARY = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")
"""What a rank says when another one died first: it is not the cause."""


def _order(rank: int, failure: Any) -> tuple[int, float, int]:
    """Root causes first: a rank that raised for its own reason, or died of a signal other than the agent's
    SIGTERM (the out-of-memory killer, a crash); then ranks that failed because a peer was gone; then ranks the
    agent stopped. Ties by time (to the microsecond where the worker wrote it: torch's timestamp is in seconds)."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    precise = message.get("extraInfo", {}).get("time") if isinstance(message, dict) else None
    text = str(message.get("message", "") if isinstance(message, dict) else message or "").lower()
    if precise is not None:
        return (2 if any(s in text for s in SECONDARY) else 0), float(precise), rank
    return (3 if failure.exitcode == -signal.SIGTERM else 1), float(failure.timestamp), rank


def _line(rank: int, failure: Any, oom: bool) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if text.startswith("while "):  # the worker's own line (lifecycle.report_failure)
        return f"rank {rank} failed {text}"
    code = failure.exitcode
    if code == -signal.SIGKILL and oom:
        return f"rank {rank} {OOM}"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} failed: {_summary(text, code)}"


def _summary(message: str, exitcode: int) -> str:
    """The line of an error that names the exception, or the exit code."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if named or lines:
        return (named or lines)[-1]
    return f"exit code {exitcode}"
