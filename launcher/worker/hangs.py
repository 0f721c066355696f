"""A collective that gave up after `trainer.collective_timeout`, told as who is stuck and where: this rank's phase, the
ranks that never came (each rank that gives up marks its phase; `launcher.worker.lifecycle.Phase.gave_up`), and on
CUDA where NCCL's flight recorder dumped the last collectives."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.base.collectives import failed_collective
from launcher.base.run_files import GAVE_UP
from launcher.worker.lifecycle import Phase
from strategies import RunContext


def stuck_in_collective(error: BaseException, phase: Phase, ctx: RunContext, timeout: float) -> RuntimeError | None:
    """The one-line error for a collective that gave up (`collective_timeout`), None for any other error."""
    if not collective_timeout(error, time.time() - phase.state[0], timeout):
        return None
    recorder = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") if ctx.device_type == "cuda" else None
    dumps = f"; NCCL's flight recorder dumps: {Path(recorder).parent} (torchfrtrace reads them)" if recorder else ""
    where = phase.now
    absent = phase.gave_up(ctx.world_size, wait=min(15.0, timeout / 4))  # the others give up within seconds
    stuck = RuntimeError(
        f"rank {ctx.rank} waited {timeout:g} s in a collective while {where}, {GAVE_UP}; {absent}{dumps}"
    )
    stuck.launch_phase = where  # type: ignore[attr-defined]
    return stuck


def collective_timeout(error: BaseException, waited: float, timeout: float) -> bool:
    """A collective that gave up after trainer.collective_timeout (`failed_collective`), this rank having waited that
    long in its phase."""
    return waited >= timeout and failed_collective(error)
