"""What the launcher sets on torch's elastic agent beyond its LaunchConfig: where the agent's own log lines go, how
long a failed worker group is given to end, and what the workers it forks are given already loaded."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

from strategies.declarations import Requirements


def preload(requirements: Requirements, device_type: str) -> None:
    """What each worker forked from this process would import and load for itself in the strategy's setup
    (DeepSpeed: about 1.5 s of imports, and seconds per compiled op it loads), done once here: every rank of every
    attempt starts with it. A module or op that fails here is left to the workers, which fail on it with their own
    report, as they would without this."""
    try:
        for module in requirements.imports:
            importlib.import_module(module)
        if requirements.ops:
            from strategies.deepspeed.ops import load_ops  # Requirements.ops are DeepSpeed's

            load_ops(requirements.ops, device_type)
    except Exception:  # noqa: BLE001 (the workers' own setup meets it again and reports it)
        return


def failed_group_grace(seconds: float, resize_timeout: float, run_dir: Path) -> None:
    """Once a worker failed, torch's agent stops the others with SIGTERM and waits a fixed 30 s before SIGKILL
    (`PContext.close()` and `LocalElasticAgent._stop_workers` take no setting; only a stop signal's shutdown uses
    `shutdown_timeout`, trainer.stop_timeout). A worker of a failed group has nothing to save (its peers are gone),
    and one that is hung or stopped never answers SIGTERM: the job ends `seconds` after the failure, not 30 s.

    A healthy group the agent stops because a node joins (nodes=MIN:MAX) has work worth saving: its ranks get
    `resize_timeout` (trainer.stop_timeout) to checkpoint the step they are in, told by `<run dir>/RESIZING` that
    this stop is a resize (`launcher.adapt.resizing`), not the user's."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    from launcher.adapt import RESIZING

    close = getattr(PContext.close, "launch_original", PContext.close)

    def close_failed(context: Any, death_sig: Any = None, timeout: float = seconds) -> None:
        close(context, death_sig, timeout)

    def stop_workers(agent: Any, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # a node is waiting to join: the group restarts at a new size
            (run_dir / RESIZING).touch()
            agent._shutdown(timeout=resize_timeout)
        else:
            agent._shutdown(timeout=seconds)

    close_failed.launch_original = close  # type: ignore[attr-defined]
    PContext.close = close_failed  # type: ignore[method-assign]
    LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]


def agent_logs_to_file(run_dir: Path) -> None:
    """The elastic agent's own log lines ("Sending process ... SIGTERM", "failed (exitcode: 1)") go to
    `<run dir>/logs/agent.log`, not the terminal: there the launcher says it once, one line per failing rank."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    file = _QuietFileHandler(run_dir / "logs" / "agent.log", delay=True)
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    file.launch_run_log = True  # type: ignore[attr-defined]
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        # the agent, its launcher, its forks
        agent = logging.getLogger(name)
        agent.propagate = False  # torch's own handler would print them on the terminal
        for handler in list(agent.handlers):
            if getattr(handler, "launch_run_log", False):
                agent.removeHandler(handler)  # the previous job's, in a sweep
                handler.close()
        agent.addHandler(file)


class _QuietFileHandler(logging.FileHandler):
    """A log file that cannot be written (a full disk) loses the agent's lines, without a traceback per line on the
    terminal: the launcher says what failed in its own line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass
