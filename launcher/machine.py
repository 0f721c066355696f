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
