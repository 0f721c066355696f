"""Looking inside a run: the profiler over chosen steps, and the CUDA allocator's memory snapshots.

- `StepProfiler`: `trainer.profile_steps=[a,b]` runs torch.profiler from the start of optimizer step a to the end of
  step b on every rank (CPU activities, and CUDA's on a GPU; shapes recorded; stacks with trainer.profile_stacks),
  each step marked `launch/step <n>`, and writes one Chrome/Perfetto trace per rank into `<run dir>/profile/`.
  Rank 0 prints its top ops by self time. Off, each step pays one comparison.
- `MemorySnapshots`: `trainer.memory_snapshot=true` records the CUDA caching allocator's history from the start
  (`torch.cuda.memory._record_memory_history`) and dumps it (`torch.cuda.memory._dump_snapshot`) into
  `<run dir>/memory/` after `trainer.memory_snapshot_step` and on an out-of-memory error. The CPU allocator keeps no
  such history: on CPU nothing is recorded, and an out-of-memory error says so.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

MEMORY_VIZ = "https://pytorch.org/memory_viz"
TOP_OPS = 15
HISTORY_ENTRIES = 100_000
"""Allocation events kept by the recorder (torchtitan's default): the newest, when a run makes more."""


class StepProfiler:
    def __init__(self, steps: Any, run_dir: Path, rank: int, device_type: str, stacks: bool = False) -> None:
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps is not None else (0, -1)
        self.path = run_dir / "profile" / f"rank{rank}.json"
        self.rank, self.device_type, self.stacks = rank, device_type, stacks
        self.profile: Any = None

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    def step(self, step: int) -> AbstractContextManager[Any]:
        """Around one optimizer step (its data, forward, backward and optimizer step)."""
        if not self.covers(step):
            return nullcontext()
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.profile = profile(activities=activities, record_shapes=True, with_stack=self.stacks)
            self.profile.__enter__()
        return torch.profiler.record_function(f"launch/step {step}")

    def ended(self, step: int) -> None:
        """After the step's region closed: the last profiled step writes the trace (and rank 0 prints its top ops)."""
        if step != self.last or self.profile is None:
            return
        profile, self.profile = self.profile, None
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        profile.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.path))
        if self.rank == 0:
            by = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
            table = profile.key_averages().table(sort_by=by, row_limit=TOP_OPS)
            print(
                f"launch: profile of steps {self.first}-{self.last}: one trace per rank in {self.path.parent} "
                f"(open in https://ui.perfetto.dev); rank 0's top ops by self time:\n{table}",
                flush=True,
            )


class MemorySnapshots:
    def __init__(self, enabled: bool, at_step: int | None, run_dir: Path, rank: int, device_type: str) -> None:
        self.enabled, self.at_step, self.rank = enabled, at_step, rank
        self.dir = run_dir / "memory"
        self.recording = enabled and device_type == "cuda"

    def start(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def after_step(self, step: int) -> None:
        if self.recording and step == self.at_step:
            path = self.dump(f"step{step}")
            if self.rank == 0:
                print(f"launch: memory snapshot of step {step}: {path} (view it at {MEMORY_VIZ})", flush=True)

    def dump(self, name: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}-{name}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def out_of_memory(self, error: BaseException) -> RuntimeError:
        """The one-line error for an out-of-memory error, with the snapshot dumped at that moment when recording (the
        launcher prefixes the rank and where in the run it was)."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        said = f"out of memory ({first})"
        if self.recording:
            return RuntimeError(f"{said}; memory snapshot: {self.dump('oom')} (view it at {MEMORY_VIZ})")
        if self.enabled:
            return RuntimeError(f"{said}; no memory snapshot: the CPU allocator keeps no history (CUDA only)")
        return RuntimeError(
            f"{said}; rerun with trainer.memory_snapshot=true to record where the memory went (CUDA; {MEMORY_VIZ}), "
            "or see what fits with launch plan"
        )
