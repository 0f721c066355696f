"""What this machine has: visible GPUs and the CPUs this process may use. Probes only; nothing here decides."""

from __future__ import annotations

import os
from pathlib import Path


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup (v2 or v1) CPU quota.

    os.cpu_count() counts the host's CPUs; inside a container limited to a few, thread pools
    sized by it oversubscribe the cores many times over.
    """
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    v2, v1 = Path("/sys/fs/cgroup/cpu.max"), Path("/sys/fs/cgroup/cpu")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]  # "max 100000" when unlimited
        else:
            quota, period = ((v1 / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))  # -1: unlimited
        if quota not in ("max", "-1"):
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count


def ephemeral_port_floor() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768), from which it picks ports by itself."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux)."""
    import socket

    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo" or n.startswith("lo")), "lo")


def memory_cgroups() -> list[Path]:
    """This process's memory cgroup folders: the v2 unified one, or the v1 memory controller's."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2, unified
            dirs.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            dirs.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return [d for d in dirs if d.is_dir()]


def memory_available() -> tuple[float, float]:
    """The machine's total and available memory, in bytes (`/proc/meminfo`), capped by a cgroup limit."""
    info: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = float(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    total, available = info.get("MemTotal", 0.0), info.get("MemAvailable", 0.0)
    for limit_file in [f for d in memory_cgroups() for f in (d / "memory.max", d / "memory.limit_in_bytes")]:
        try:
            limit = float(limit_file.read_text().strip())
        except (OSError, ValueError):
            continue
        total, available = min(total, limit), min(available, limit)
    return total, available
