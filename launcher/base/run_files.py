"""The names the launcher and its workers share through the run directory and the environment: the flags a failing
rank touches and the agents watch, the resize flag, the flight recorder's folder, each rank's host record, the words a
rank that waited too long says. Both sides import them from here, neither from the other."""

from __future__ import annotations

import json
from pathlib import Path

GAVE_UP = "then gave up"
"""How a rank says it waited trainer.collective_timeout in a collective (`launcher.worker.runner`): the others are
stuck."""


WAITING = "gave up waiting in a collective"
"""How a rank's phase file says it gave up (`Phase.gave_up`): the ranks whose files do not say so are the ones at
fault."""


FLIGHT_RECORDER = Path("logs") / "flight_recorder"
"""Where, in a run directory on CUDA, NCCL's flight recorder dumps each rank's last collectives on a timeout."""


FLIGHT_RECORDER_ENV = {
    # Any of these names set by the user: the user's choice stands, and the launcher sets none of its group.
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",  # collectives kept per rank
    ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): "{dir}/rank_",  # the file prefix; rank appended
}


def flight_recorder_env(run_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The variables that turn NCCL's flight recorder on for a CUDA run, except those the user already set."""
    folder = str(run_dir / FLIGHT_RECORDER)
    return {
        names[0]: value.format(dir=folder)
        for names, value in FLIGHT_RECORDER_ENV.items()
        if not any(name in environ for name in names)
    }


NODE_ID_ENV = "LAUNCH_NODE_ID"
"""Set by each node's launcher for its workers: which launcher started a rank (`joined`)."""


def host_of(run_dir: Path, rank: int) -> str | None:
    """The host `joined` wrote for `rank`; None where its record cannot be read."""
    try:
        return json.loads((run_dir / "logs" / "ranks" / f"rank{rank}.json").read_text()).get("host")
    except (OSError, ValueError):
        return None


IN_PLACE = "in-place.json"
"""`<run dir>/logs/in-place.json`: written by rank 0 after a recovery in place (`launcher.worker.runner`), the nodes
that go on; the agents' exit barrier waits for those alone (`launcher.elastic.agent.Agent._exit_barrier`)."""
FAILED_FLAG = "failed"
"""`<run dir>/logs/failed`: touched by each rank that reports a failure, after its report: one file that the agents of
the job's other nodes can look at every few seconds on a shared file system, where a glob of the reports would not."""


FAILURE_DIR_ENV = "LAUNCH_FAILURE_DIR"
"""A folder the launcher makes off the run directory's disk (in memory where it can): a worker whose failure report
cannot be written where the elastic agent expects it (`<run dir>/logs/` on a full disk) writes it there."""


RESIZING = "logs/resizing"
"""Touched by the elastic agent when it stops a healthy worker group because a node joins (`launcher.elastic.agent`)."""
