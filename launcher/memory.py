"""A rank's honest memory figures: the peak of what is really allocated during a step, not the process's RSS.

On CUDA: the allocator's peak of allocated bytes over the step (`torch.cuda.max_memory_allocated`).
On CPU, RSS does not show what sharding saves (freed pages stay with the process), so the peak is measured at the
dispatch level: during a measured step every operator is followed by a reading of the C heap's bytes in use
(glibc's `mallinfo2`: every tensor's storage, DDP's gradient buckets, DeepSpeed's buffers, whatever allocated them),
and the figure is the highest reading less the bytes in use before the run built its model (torch, and the datasets,
which live in host memory on any device), and less what the modules imported since keep: code and tables, not
tensors. Compiled code runs no operators one by one (and an active dispatch mode would make torch.compile give up
compiling), so under `trainer.compile` a thread samples the same reading instead, every 200 microseconds; so it does
for a strategy's setup (which builds, shards and may patch torch's constructors, as DeepSpeed's zero.Init does). Only
the steps the runner asks for are measured (on CPU: the first logged step, the last and every trainer.memory_every-th,
the probe costing about a fifth of a step); the others pay nothing.
"""

from __future__ import annotations

import builtins
import ctypes
import ctypes.util
import functools
import importlib
import resource
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )  # fmt: skip
    ]


@functools.cache
def _mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc (>= 2.33): no heap figure, RSS only
        return None
    function.restype = _MallInfo2
    return function


def heap_bytes() -> int | None:
    """Bytes the C heap has handed out and not taken back (small blocks in arenas, large ones mapped)."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def rss_bytes() -> int:
    """The process's peak resident set size (what the kernel counts against it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class _HeapPeak(TorchDispatchMode):
    """The highest heap reading after any operator inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = heap_bytes() or 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        now = heap_bytes() or 0
        if now > self.peak:
            self.peak = now
        return out


class _HeapSampler:
    """The highest heap reading a background thread sees inside the block (for compiled code)."""

    def __init__(self) -> None:
        self.peak = heap_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="heap-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(2e-4):  # the wait and the ctypes call both release the GIL
            self.peak = max(self.peak, heap_bytes() or 0)

    def __enter__(self) -> _HeapSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, heap_bytes() or 0)


class StepMemory:
    """Measures the peak of one step at a time: `with memory.measure(on): ...`, then `memory.peak`."""

    def __init__(self, device: torch.device, compiled: bool = False) -> None:
        self.device, self.compiled = device, compiled
        self.base = heap_bytes() or 0
        """In use before the run built anything: what a bare torch process already holds."""
        self.peak: int | None = None

    @contextmanager
    def imports_excluded(self) -> Iterator[None]:
        """Inside the block, the heap that a module imported for the first time keeps (its code, its tables: not
        tensors, and not the model's) joins the base: DeepSpeed or transformers imported while the model is built do
        not count as the run's memory."""
        real_import, real_import_module, depth = builtins.__import__, importlib.import_module, 0

        def excluded(function: Any) -> Any:
            @functools.wraps(function)
            def wrapper(name: str, *args: Any, **kwargs: Any) -> Any:
                nonlocal depth
                if depth or name in sys.modules:
                    return function(name, *args, **kwargs)
                depth, before = 1, heap_bytes() or 0
                try:
                    return function(name, *args, **kwargs)
                finally:
                    depth, self.base = 0, self.base + max(0, (heap_bytes() or 0) - before)

            return wrapper

        builtins.__import__, importlib.import_module = excluded(real_import), excluded(real_import_module)
        try:
            yield
        finally:
            builtins.__import__, importlib.import_module = real_import, real_import_module

    def measure(self, enabled: bool, sampled: bool = False) -> Any:
        """The block's peak into `self.peak` (None when not `enabled`: no figure, rather than an older step's);
        `sampled`: by the thread on CPU, whatever the block runs."""
        if not enabled:
            self.peak = None
            return _Nothing()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return _CudaPeak(self)
        if heap_bytes() is None:
            return _Nothing()
        return _Heap(self, sampled or self.compiled)


class _Nothing:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


class _CudaPeak(_Nothing):
    def __init__(self, memory: StepMemory) -> None:
        self.memory = memory

    def __exit__(self, *exc: Any) -> None:
        self.memory.peak = torch.cuda.max_memory_allocated(self.memory.device)


class _Heap(_Nothing):
    def __init__(self, memory: StepMemory, sampled: bool) -> None:
        self.memory = memory
        self.mode: _HeapPeak | _HeapSampler = _HeapSampler() if sampled else _HeapPeak()

    def __enter__(self) -> None:
        self.mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        self.memory.peak = max(0, self.mode.peak - self.memory.base)
