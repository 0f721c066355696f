"""Helpers for tests that watch or signal a run's processes from outside, as a cluster would."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the live workers of a run."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and "launcher.worker" in (cmd := (proc / "cmdline").read_bytes().decode())
                and str(run_dir) in cmd
            ):
                env = dict(e.split("=", 1) for e in (proc / "environ").read_bytes().decode().split("\0") if "=" in e)
                found[int(env["RANK"])] = int(proc.name)
        except (OSError, KeyError, ValueError):
            pass
    return found


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never reached step {step}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
