"""Helpers for tests that watch or signal a run's processes from outside, as a cluster would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def run_processes(run_dir: Path) -> list[int]:
    """The run's own processes: its launcher (`hydra.run.dir=<run dir>`) and its workers (forked from the launcher,
    or `<run dir>/resolved.yaml`), matched as whole arguments: another test's launch that only names the run
    (`resume=<run dir>`) is not one of them."""
    own = {f"hydra.run.dir={run_dir}", str(run_dir / "resolved.yaml")}
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and own.intersection((proc / "cmdline").read_bytes().decode().split("\0")):
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return [p for p in pids if p != os.getpid()]


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the live workers of a run (each names itself `launch-rank<N>`: launcher.worker.lifecycle)."""
    found = {}
    for pid in run_processes(run_dir):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("launch-rank"):
            found[int(comm.removeprefix("launch-rank"))] = pid
    return found


def tcp_addresses(pid: int) -> dict[str, tuple[str, bool]]:
    """Socket inode -> (local address, listening) of each TCP socket process `pid` holds (IPv4 and IPv6)."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:  # the local address: 32-bit words in host (little-endian) order, then the port
                raw = bytes.fromhex(fields[1].split(":")[0])
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(packed)
                mapped = getattr(address, "ipv4_mapped", None)
                addresses[fields[9]] = (str(mapped or address), fields[3] == "0A")  # 0A: LISTEN
    return addresses


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


def listening(port: int) -> bool:
    """Whether something on this machine accepts connections on 127.0.0.1:`port` (a store, a server just started)."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def until(condition: Callable[[], bool], *nodes: subprocess.Popen[str], what: str) -> None:
    """Wait (5 minutes at most) for `condition`, while every one of `nodes` runs: one that ends first fails the test."""
    for _ in range(3000):
        if condition():
            return
        assert all(n.poll() is None for n in nodes), f"a node ended before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within 300 s")
