"""What the launcher sets on torch's elastic agent beyond its LaunchConfig: where the agent's own log lines go, how
long a failed worker group is given to end, and what the workers it forks are given already loaded."""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path
from typing import Any

from launcher.parent.failures import STOPPED_BY_LAUNCHER, peer_failure
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
    """Once a worker failed, torch stops the others with SIGTERM and waits a fixed 30 s before SIGKILL (forked
    workers: `torch.multiprocessing`'s `ProcessContext.join`; started ones: `PContext.close()` and
    `LocalElasticAgent._stop_workers`, which take no setting; only a stop signal's shutdown uses `shutdown_timeout`,
    trainer.stop_timeout). A worker of a failed group has nothing to save (its peers are gone): here the others get
    `seconds` after SIGTERM, and a worker that cannot act on SIGTERM none (`end_unresponsive`: one stopped, by
    SIGSTOP or a debugger, or every worker still alive after a rank gave up waiting in a collective).

    A healthy group the agent stops because a node joins (nodes=MIN:MAX) has work worth saving: its ranks get
    `resize_timeout` (trainer.stop_timeout) to checkpoint the step they are in, told by `<run dir>/RESIZING` that
    this stop is a resize (`launcher.worker.adapt.resizing`), not the user's."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, PContext
    from torch.multiprocessing.spawn import ProcessContext

    from launcher.worker.adapt import RESIZING

    close = getattr(PContext.close, "launch_original", PContext.close)
    poll = getattr(MultiprocessContext._poll, "launch_original", MultiprocessContext._poll)
    wait = getattr(ProcessContext._join_procs_with_timeout, "launch_original", ProcessContext._join_procs_with_timeout)

    def close_failed(context: Any, death_sig: Any = None, timeout: float = seconds) -> None:
        for local_rank, pid in context.pids().items():
            if _stopped(pid):
                _kill(pid, context, local_rank, "it is stopped (state T) and cannot act on SIGTERM")
        close(context, death_sig, timeout)

    def poll_failed(context: Any) -> Any:
        if context._pc is not None:
            context._pc.launch_context = context  # for `wait_failed`, once torch's join found a failed worker
        return poll(context)

    def wait_failed(pc: Any, timeout: float) -> None:
        """torch's join, once a forked worker failed, sends SIGTERM to the others and waits here (30 s)."""
        context = getattr(pc, "launch_context", None)
        if context is not None:
            end_unresponsive(context)
            timeout = min(timeout, seconds)
        wait(pc, timeout)

    def stop_workers(agent: Any, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # a node is waiting to join: the group restarts at a new size
            (run_dir / RESIZING).touch()
            agent._shutdown(timeout=resize_timeout)
        else:
            agent._shutdown(timeout=seconds)

    close_failed.launch_original = close  # type: ignore[attr-defined]
    poll_failed.launch_original = poll  # type: ignore[attr-defined]
    wait_failed.launch_original = wait  # type: ignore[attr-defined]
    PContext.close = close_failed  # type: ignore[method-assign]
    MultiprocessContext._poll = poll_failed  # type: ignore[method-assign]
    ProcessContext._join_procs_with_timeout = wait_failed  # type: ignore[method-assign]
    LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]


def stop_with_failed_peers(run_dir: Path | None, every: float = 2.0) -> None:
    """A node's workers, all alive, of a job that cannot restart (no restart left to its agent), while another node's
    rank has failed: the job has ended, and torch's agent would not know it until a rendezvous call to the store
    timed out (its host gone: 2 min here), or ever (the store on this node, its rank hung outside a collective). The
    agent's monitor looks every `every` s for the flag a failing rank touches (`lifecycle.FAILED_FLAG`, one file:
    cheap on a shared file system), and once it is newer than this attempt's workers and some rank's report there
    is a cause (`failures.peer_failure`), kills this node's workers; the launcher then says that cause, as on any
    node whose ranks stopped with it. With restarts left, torch's restart stops them instead. `run_dir` None (a job
    of one node, whose agent sees its failed workers itself): torch's monitor, as it is."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from launcher.worker.lifecycle import FAILED_FLAG

    monitor = getattr(LocalElasticAgent._monitor_workers, "launch_original", LocalElasticAgent._monitor_workers)
    if run_dir is None:
        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        return
    folder = run_dir
    flag = folder / "logs" / FAILED_FLAG
    started: dict[int, float] = {}  # each attempt's process context -> when its workers were first seen running
    looked = 0.0

    def watched(agent: Any, worker_group: Any) -> Any:
        nonlocal looked
        result = monitor(agent, worker_group)
        context, now = agent._pcontext, time.time()
        if context is None or result.state != WorkerState.HEALTHY or agent._remaining_restarts > 0:
            return result
        since = started.setdefault(id(context), now)
        if now - looked < every:
            return result
        looked = now
        try:
            failed = flag.stat().st_mtime >= since
        except OSError:
            return result
        if failed and peer_failure(folder, since):
            for local_rank, pid in context.pids().items():
                _kill(pid, context, local_rank, "a rank of another node failed, and the job has no restart left")
        return result

    watched.launch_original = monitor  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = watched  # type: ignore[method-assign]


def end_unresponsive(context: Any) -> None:
    """A forked worker failed and the others were sent SIGTERM: kill at once those that cannot act on it, a stopped
    one (state T), or every one still alive once a rank gave up waiting in a collective (the others are stuck, or
    waiting on the stuck one: nothing of theirs would end in time)."""
    stuck = _gave_up(context.error_files.values())
    for rank, process in enumerate(context._pc.processes):
        if process.exitcode is not None:
            continue
        if stuck:
            _kill(process.pid, context, rank, "a rank gave up waiting for it in a collective")
        elif _stopped(process.pid):
            _kill(process.pid, context, rank, "it is stopped (state T) and cannot act on SIGTERM")


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): a signal other than SIGKILL waits for it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _gave_up(error_files: Any) -> bool:
    """A failed rank's report says it gave up waiting in a collective (the runner's words for a collective timeout)."""
    from launcher.worker.lifecycle import GAVE_UP

    for file in error_files:
        try:
            if GAVE_UP in Path(file).read_text():
                return True
        except OSError:
            continue
    return False


def _kill(pid: int, context: Any, local_rank: int, why: str) -> None:
    """SIGKILL a worker without waiting, said in the agent's log; its exit is then no failure of its own."""
    import os
    import signal

    rank = context.envs.get(local_rank, {}).get("RANK", local_rank)
    logging.getLogger("torch.distributed.elastic").warning(
        "launch: killing rank %s (pid %s) at once: %s", rank, pid, why
    )
    STOPPED_BY_LAUNCHER.add(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
