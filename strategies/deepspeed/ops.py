"""DeepSpeed's compiled ops, as the launcher sees them: whether one can run here (the smoke sweep leaves a preset out,
a strategy's check refuses it, in one line), and loading them once into a process that forks its workers."""

from __future__ import annotations

import functools
import os
from typing import Any


def op_problem(op: str, device_type: str) -> str | None:
    """Why DeepSpeed's op `op` (a `Requirements.ops` name) cannot run here, or None."""
    if op == "shm_comm":  # where it cannot build, DeepSpeed's collectives go through torch's
        return None
    if op == "async_io":
        return async_io_problem(device_type)
    if not _is_compatible(_builder(op, device_type)):
        return f"DeepSpeed's {op} op cannot be built here (it compiles with the system's C++ compiler on first use)"
    return None


def load_ops(ops: tuple[str, ...], device_type: str) -> None:
    """Load DeepSpeed's ops `ops` (`Requirements.ops` names) into this process, building any not built yet: a process
    that forks its workers afterwards gives each of them the loaded op (DeepSpeed keeps it, `OpBuilder._loaded_ops`).

    Each load asks py-cpuinfo twice for the CPU's features, and each answer costs a fresh Python process (about a
    second): the answer, which cannot change while this process lives, is asked once."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    for op in ops:
        if op == "shm_comm":
            _load_shm_comm(device_type)
        else:
            _builder(op, device_type).load(verbose=False)


def _load_shm_comm(device_type: str) -> None:
    """DeepSpeed's shared-memory collectives, which each CPU rank's `deepspeed.comm` loads for itself after probing
    every op builder (compiler runs, about 0.3 s a rank), loaded here as that rank would: the probe's answer
    (`deepspeed.ops.__compatible_ops__`) and the op are then every forked rank's. Nothing on another device."""
    if device_type != "cpu":
        return
    _builder("cpu_adam", device_type)  # DS_ACCELERATOR, and DeepSpeed imported as the launcher imports it
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    if deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def _builder(op: str, device_type: str) -> Any:
    """DeepSpeed's builder of the op `op` (a `Requirements.ops` name) for `device_type`."""
    os.environ.setdefault("DS_ACCELERATOR", device_type)  # no accelerator guess (and warning) in the launcher
    import strategies.deepspeed.imported  # noqa: F401, I001  # before any `import deepspeed`
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    builders = {"cpu_adam": CPUAdamBuilder, "async_io": AsyncIOBuilder}
    if op not in builders:
        raise ValueError(f"no DeepSpeed op named {op}")
    return builders[op]()


def async_io_problem(device_type: str) -> str | None:
    """Why DeepSpeed's async I/O op (NVMe offload) cannot run here, or None."""
    builder = _builder("async_io", device_type)
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("async_io"):
        try:
            builder.load(verbose=False)
        except ImportError as e:  # a CPU-only DS_BUILD_AIO=1 build misses -laio (deepspeed 0.19.8)
            return (
                f"DeepSpeed's prebuilt async_io op does not load ({e}); reinstall deepspeed without DS_BUILD_AIO=1: "
                "the op then compiles on first use"
            )
    elif not _is_compatible(builder):
        return (
            "NVMe offload needs DeepSpeed's async_io op, which needs libaio: install it "
            "(Debian/Ubuntu: apt-get install libaio-dev) and run again"
        )
    return None


def _is_compatible(builder) -> bool:
    """DeepSpeed's own test (it compiles and links a call to io_submit), with a standard error that has a file
    descriptor: the test points that descriptor at a file and, on a stream without one (a notebook's, a redirected
    StringIO), answers "incompatible" though libaio is there. What the test prints is nobody's business but its own:
    the compiler's command lines (logged at INFO by its `compilers` logger) and the linker's "cannot find -laio" are
    kept off the terminal, at the level of the file descriptors too, where the compiler writes."""
    import contextlib
    import logging
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    previous = logging.root.manager.disable
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        logging.disable(logging.INFO)
        try:
            return bool(builder.is_compatible(verbose=False))
        finally:
            logging.disable(previous)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
