"""Models that misbehave on purpose, for fault tests: `model._target_=faulty.RaisingGPT` (tests/ is on PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from launcher.models.gpt import GPT


class _Faulty(GPT):
    def __init__(self, *args, bad_rank: int = 1, at_call: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad = int(os.environ.get("RANK", "0")) == bad_rank
        self.at_call, self.calls = at_call, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.bad and self.calls == self.at_call:
            self.fail()
        return super().forward(idx, targets)

    def fail(self) -> None:
        raise NotImplementedError


class RaisingGPT(_Faulty):
    def fail(self) -> None:
        raise RuntimeError(f"rank {os.environ['RANK']} broke on purpose")


class HangingGPT(_Faulty):
    def fail(self) -> None:
        time.sleep(3600)  # alive but stuck: only the collective timeout can end the job


class HungryGPT(_Faulty):
    def fail(self) -> None:
        hoard = []
        while True:  # until the kernel's out-of-memory killer ends this process
            hoard.append(torch.ones(2**24))  # 64 MiB a time, touched


class OutOfMemoryGPT(_Faulty):
    def fail(self) -> None:
        # What the CUDA caching allocator raises (torch.cuda.OutOfMemoryError is torch.OutOfMemoryError).
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class DiskFillingGPT(_Faulty):
    """Fills the file system of `fill` but `leave` bytes (as another process writing to the run's disk would), then
    trains on."""

    def __init__(self, *args, fill: str = "", leave: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fill, self.leave = fill, leave

    def fail(self) -> None:
        with open(self.fill, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(1 << 12))
            except OSError:  # full
                f.truncate(max(0, f.tell() - self.leave))


class SmallMemoryGPT(GPT):
    """A device that holds `fits` samples per forward: from its `at_call`-th forward on, every rank whose micro-batch
    is larger runs out of memory, as the CUDA allocator says it (batch.micro_size=auto halves it until it fits)."""

    def __init__(self, *args, fits: int = 2, at_call: int = 5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fits, self.at_call, self.calls = fits, at_call, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if idx.shape[0] > self.fits and self.calls >= self.at_call and torch.is_grad_enabled():
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {idx.shape[0]} samples")
        return super().forward(idx, targets)


class SlowGPT(GPT):
    """The built-in GPT whose training forward sleeps `sleep_s` seconds on rank `slow_rank` (None: every rank), read
    from the process group inside forward (the launcher's own forward, before any group exists, never sleeps): a
    straggler, or a run slow enough for a test to act between its steps, while the file `while_there` exists (when
    one is named): the test removes it to let the run finish at full speed."""

    def __init__(self, *args, sleep_s: float = 0.0, slow_rank: int | None = 1, while_there: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_s, self.slow_rank, self.while_there = sleep_s, slow_rank, while_there

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        held = not self.while_there or os.path.exists(self.while_there)
        if held and self.training and dist.is_initialized() and self.slow_rank in (None, dist.get_rank()):
            time.sleep(self.sleep_s)
        return super().forward(idx, targets)


class KilledGPT(_Faulty):
    """SIGKILLed at its call `at_call` of each attempt while the file `while_there` exists: a worker lost to the
    kernel, a node or an operator, as often as the test wants (remove the file to let the run go on)."""

    def __init__(self, *args, while_there: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.while_there = while_there

    def fail(self) -> None:
        if os.path.exists(self.while_there):
            os.kill(os.getpid(), signal.SIGKILL)


class StoppedGPT(_Faulty):
    """Sends SIGTERM to its launcher (the process that forked it) at its call `at_call` of each attempt, on rank
    `bad_rank`: a stop signal mid-run, as SLURM sends one to preempt a job."""

    def fail(self) -> None:
        os.kill(os.getppid(), signal.SIGTERM)


class AbortedGPT(_Faulty):
    """Aborted (SIGABRT, as gloo aborts a rank whose collectives no longer match) while it waits in torch.distributed:
    a receive no rank sends to, interrupted a second later."""

    def fail(self) -> None:
        import threading

        threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGABRT)).start()
        dist.recv(torch.zeros(1), src=0)


class KilledOnceGPT(SlowGPT):
    """A forward of `sleep_s` seconds on every rank; rank `bad_rank` SIGKILLed after its forward `at_call`, once: the
    file `while_there` is removed first, so the restarted group trains on (a worker lost alone, its node alive)."""

    def __init__(self, *args, bad_rank: int = 1, at_call: int = 3, whole_node: bool = False, **kwargs) -> None:
        super().__init__(*args, slow_rank=None, **kwargs)
        self.bad, self.at_call, self.calls = int(os.environ.get("RANK", "0")) == bad_rank, at_call, 0
        self.whole_node = whole_node
        """The node lost with it: its launcher too (the process group of the launcher's session)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = super().forward(idx, targets)  # mid-step: after its sleep
        self.calls += 1 if self.training else 0
        if self.bad and self.calls == self.at_call and os.path.exists(self.while_there):
            os.remove(self.while_there)
            if self.whole_node:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return loss
