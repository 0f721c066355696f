"""A rank's honest memory figures: the peak of what the run really holds during a step, not the process's RSS.

On CUDA: the allocator's peak of allocated bytes over the step (`torch.cuda.max_memory_allocated`).
On CPU, RSS does not show what sharding saves (freed pages stay with the process), and the C heap holds, beside the
run's tensors, what the machine's libraries keep (MKL's and oneDNN's workspaces, thread arenas: more with AVX2
kernels than with AVX-512 ones), so the peak is the run's tensor storages, counted at the dispatch level
(`LiveStorages`): during a measured window every operator's inputs and outputs are looked at, each CPU storage not
yet known is counted with its bytes, and a weak reference on it takes them off when it is freed. The figure is the
highest count after any operator. What the planner models (weights, gradients, optimizer state, buffers, the
activations autograd keeps, a strategy's buckets) is exactly that; the same step measures the same bytes on any
processor. What the heap holds beyond the counted storages is a separate figure (`heap_other_bytes`), read once at
the end of a measured step, never compared with a plan.

The count sees what an operator makes and uses; it cannot see a storage made by code that runs no operator one by
one: compiled code (and an active dispatch mode would make torch.compile give up compiling), so under
`trainer.compile` and in profiled steps (where the probe would fill the trace) the step's peak is not measured on CPU.
The strategy's setup is measured likewise (which counts, from their birth, the storages the model state lives in), and
the storages a resumed checkpoint's state is loaded into are counted.
Only the steps the runner asks for are measured (on CPU: the first logged step, the last and every
trainer.memory_every-th); the others pay nothing.
"""

from __future__ import annotations

import builtins
import ctypes
import ctypes.util
import functools
import importlib
import resource
import sys
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


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
        )
    ]


@functools.cache
def _mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc (>= 2.33): no heap figure
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


class _Held(weakref.ref):
    """A weak reference to a counted storage, with its key and the bytes counted for it."""

    __slots__ = ("key", "nbytes")

    def __new__(cls, storage: Any, callback: Any, key: int, nbytes: int) -> _Held:
        return super().__new__(cls, storage, callback)

    def __init__(self, storage: Any, callback: Any, key: int, nbytes: int) -> None:
        super().__init__(storage, callback)
        self.key, self.nbytes = key, nbytes


class LiveStorages:
    """The bytes of the CPU tensor storages alive now, of those seen: counted from the operator that made one (or
    first used it, for one made where no operator showed it: in a gloo thread, between two measured windows) until
    it is freed. torch keeps a storage's Python object as long as the storage lives, so a weak reference to that
    object says when the storage is freed; frees are queued by the reference's callback (which may run in any
    thread) and taken off by the counting thread. Only storages an allocator owns count (`resizable`): a tensor over
    a NumPy array or a memory-mapped file (the data set) is not the run's memory."""

    def __init__(self) -> None:
        self.known: dict[int, _Held] = {}
        self.freed: deque[_Held] = deque()
        self.live = 0

    def drain(self) -> None:
        """Take off the storages freed since the last call."""
        freed, known = self.freed, self.known
        while freed:
            held = freed.popleft()
            if known.get(held.key) is held:
                del known[held.key]
                self.live -= held.nbytes

    def recount(self) -> None:
        """Every known storage's bytes read again: one resized outside a window (FSDP frees and refills its
        unsharded parameters by resizing their storages) counts what it holds now."""
        self.drain()
        for held in list(self.known.values()):
            storage = held()
            if storage is not None:
                self.count(storage)

    def see(self, tensor: torch.Tensor, fresh: bool = True) -> None:
        """Count `tensor`'s storage if it is new. `fresh`: an operator's result, whose storage may have been resized
        in place (`resize_`, `set_`): a known one is counted at its size now; an input is only looked up."""
        if type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor):  # DTensor: the tensors it wraps
            names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            for inner in (getattr(tensor, name) for name in names):
                if isinstance(inner, torch.Tensor):
                    self.see(inner, fresh)
            return
        if not tensor.is_cpu:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, or no storage at all
            return
        held = self.known.get(storage._cdata)
        if held is None or fresh or held() is not storage:
            self.count(storage)

    def count(self, storage: Any) -> None:
        """Count `storage` if it is new, a known one at its size now."""
        if storage.device.type != "cpu":
            return
        key, nbytes = storage._cdata, storage.nbytes()
        held = self.known.get(key)
        if held is not None:
            if held() is storage:
                if held.nbytes != nbytes:  # resized in place
                    self.live += nbytes - held.nbytes
                    held.nbytes = nbytes
                return
            del self.known[key]  # freed, its callback not drained yet: a new storage at the same address
            self.live -= held.nbytes
        if not nbytes or not storage.resizable():
            return
        self.known[key] = _Held(storage, self.freed.append, key, nbytes)
        self.live += nbytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that wrap no other tensor (the common case, told without asking)."""


def _see_all(see: Any, values: Any, fresh: bool) -> None:
    """`see` every tensor among an operator's arguments or results: one, or in a list or tuple (one level: what
    operators take and give)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            see(value, fresh)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    see(item, fresh)


class _StoragePeak(TorchDispatchMode):
    """The highest count of live storages after any operator inside the block."""

    def __init__(self, storages: LiveStorages) -> None:
        super().__init__()
        self.storages = storages
        storages.recount()
        self.peak = storages.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        storages = self.storages
        # An input not known yet was made where no operator showed it (another thread, between two windows): counted
        # from now on.
        _see_all(storages.see, args, False)
        if kwargs:
            _see_all(storages.see, kwargs.values(), False)
            out = func(*args, **kwargs)
        else:
            out = func(*args)
        _see_all(storages.see, out if isinstance(out, (list, tuple)) else (out,), True)
        if storages.freed:
            storages.drain()
        if storages.live > self.peak:
            self.peak = storages.live
        return out


class StepMemory:
    """Measures the peak of one step at a time: `with memory.measure(on): ...`, then `memory.peak` (and, on CPU,
    `memory.heap_other`)."""

    def __init__(self, device: torch.device, compiled: bool = False) -> None:
        self.device, self.compiled = device, compiled
        self.base = heap_bytes() or 0
        """The heap in use before the run built anything: what a bare torch process and the data already hold."""
        self.storages = LiveStorages()
        self.peak: int | None = None
        self.heap_other: int | None = None

    @contextmanager
    def imports_excluded(self) -> Iterator[None]:
        """Inside the block, the heap that a module imported for the first time keeps (its code, its tables: not
        tensors, and not the model's) joins the base of `heap_other`: DeepSpeed or transformers imported while the
        model is built are not the run's memory."""
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

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Inside the block the storages made are counted, with no figure of its own: a resumed checkpoint's state,
        loaded between the setup and the first step, is in the first step's peak."""
        if self.device.type == "cuda":
            yield
            return
        with _resizes_seen(self.storages), _StoragePeak(self.storages):
            yield

    @contextmanager
    def measure(self, enabled: bool, profiled: bool = False) -> Iterator[None]:
        """The block's peak into `self.peak`, and on CPU what the heap holds beyond the counted storages at its end
        into `self.heap_other` (both None when not `enabled`: no figure, rather than an older step's). On CPU neither
        for compiled code or a `profiled` block: the count would not see the one, and would fill the other's trace."""
        self.peak = self.heap_other = None
        if not enabled:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        if self.compiled or profiled:
            yield
            return
        with _resizes_seen(self.storages), _StoragePeak(self.storages) as mode:
            yield
        self.peak = mode.peak
        self.storages.drain()
        heap = heap_bytes()
        if heap is not None:
            self.heap_other = heap - self.base - self.storages.live


@contextmanager
def _resizes_seen(storages: LiveStorages) -> Iterator[None]:
    """Inside the block, a storage resized in place (`UntypedStorage.resize_`, which runs no operator: FSDP frees an
    unsharded parameter's memory so, and refills it) is counted at its new size at once."""
    from launcher.adapters.torch_private import resizes_seen

    with resizes_seen(storages.count):
        yield
