"""The launcher's elastic agent: torch's `LocalElasticAgent`, with the launcher's way of ending a worker group given
through the hooks torch documents for implementors of `SimpleElasticAgent` (`_monitor_workers`, `_stop_workers`,
`_shutdown`; checked against torch's own by `launcher.adapters.torch_private`), and started as torch's
`launch_agent` starts its own (`run_agent`). Also: where the agent's own log lines go, and what the workers it forks
are given already loaded."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.metrics import prof
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest, SignalException, Std

from launcher.adapters.torch_private import check_elastic
from launcher.base.run_files import FAILED_FLAG, GAVE_UP, IN_PLACE, RESIZING
from launcher.elastic.failures import STOPPED_BY_LAUNCHER, peer_failure
from launcher.elastic.rendezvous import JobFull, Rendezvous
from strategies.declarations import Requirements

MONITOR_INTERVAL = 0.1
"""Seconds between two looks at the workers: torch's `LaunchConfig` default."""
RDZV_TIMEOUT = 900
"""The rendezvous' `timeout` where the run gives none: torch's `LaunchConfig` default."""
PEERS_EVERY = 2.0
"""Seconds between two looks for another node's failed rank (`Agent.peer_failed`): one file, cheap on a shared disk."""


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


@dataclass(frozen=True)
class AgentConfig:
    """What torch's `LaunchConfig` held for the launcher, and how the launcher's agent ends a worker group."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv: Rendezvous
    max_restarts: int
    signals_to_handle: str
    """Passed on to the workers, which finish the step and checkpoint."""
    shutdown_timeout: float
    """Seconds a stopped job's workers get to save (trainer.stop_timeout); also a resize's."""
    failed_grace: float
    """Seconds the other workers of a failed group get after SIGTERM."""
    log_dir: Path
    redirects: dict[int, Std]
    start_method: str
    """fork: `entrypoint` is a function run in a forked worker; spawn: a command."""
    run_dir: Path
    watch_peers: bool
    """A job of several nodes: look for another node's failed rank (`Agent.peer_failed`)."""


def run_agent(config: AgentConfig, entrypoint: Callable[..., Any] | str, *args: str) -> dict[int, Any]:
    """Start `config.nproc_per_node` workers of `entrypoint(*args)` through the launcher's agent and wait for them:
    torch's `launch_agent` (torch.distributed.launcher.api), built from its public pieces. Each rank's return value
    by global rank; ChildFailedError once the workers failed and no restart is left. The rendezvous is closed on the
    way out, except after a stop signal (a job that goes on elsewhere keeps it) or on a node it refused (JobFull:
    the rendezvous is the running job's)."""
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    check_elastic()
    rdzv = config.rdzv
    parameters = RendezvousParameters(
        backend=rdzv.backend,
        endpoint=rdzv.endpoint,
        run_id=rdzv.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=rdzv.local_addr,
        **{"timeout": RDZV_TIMEOUT, **rdzv.configs},
    )
    master_addr, master_port = None, None
    if rdzv.backend == "static":  # its endpoint is where the workers' process group meets
        master_addr, master_port = parse_rendezvous_endpoint(rdzv.endpoint, default_port=-1)
        if master_port == -1:
            raise ValueError(f"port is missing in endpoint: {rdzv.endpoint}")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # read by torch's process context
    spec = WorkerSpec(
        role="default_role",
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=get_rendezvous_handler(parameters),
        max_restarts=config.max_restarts,
        monitor_interval=MONITOR_INTERVAL,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=rdzv.local_addr,
    )  # numa_options: torch's default for a machine of its GPUs is none outside Meta's builds
    agent = Agent(spec, config)
    close_rendezvous = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig())
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
        return result.return_values
    except (SignalException, JobFull):
        close_rendezvous = False
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


class RunLogs(DefaultLogsSpecs):
    """torch's log files of each attempt (`<log dir>/<run id>_<...>/attempt_<n>/<local rank>/`), and the latest
    attempt's error files, which the agent reads when a worker fails."""

    def __init__(self, log_dir: str, redirects: dict[int, Std]) -> None:
        super().__init__(log_dir=log_dir, redirects=redirects)
        self.error_files: dict[int, str] = {}

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        logs = super().reify(envs)
        self.error_files = dict(logs.error_files)
        return logs


class Agent(LocalElasticAgent):
    """torch's local agent, ending a worker group as the launcher needs:

    - A worker failed: torch would stop the others with SIGTERM and wait a fixed 30 s before SIGKILL (forked workers:
      `torch.multiprocessing`'s join, inside the agent's poll; started ones: the process context's close). A worker
      of a failed group has nothing to save (its peers are gone): here, before torch's poll joins them, the others
      get `failed_grace` seconds after SIGTERM, and one that cannot act on SIGTERM none: one stopped (by SIGSTOP or a
      debugger), or every one still alive once a rank gave up waiting in a collective (`_end_failed_group`).
    - A healthy group stopped because a node joins (nodes=MIN:MAX) has work worth saving: its ranks get
      `shutdown_timeout` (trainer.stop_timeout) to checkpoint the step they are in, told by `<run dir>/logs/resizing`
      that this stop is a resize (`launcher.recovery.adapt.resizing`), not the user's (`_stop_workers`).
    - Any stop: a stopped worker is killed at once (`_shutdown`).
    - A node's workers, all alive, of a job that cannot restart, while another node's rank failed: killed
      (`peer_failed`).

    Workers are read by their process ids (`Worker.id`, the pid for a local agent) and their exit status without
    reaping them (`os.waitid` with WNOWAIT): torch's poll reaps and reports them as it always does."""

    def __init__(self, spec: WorkerSpec, config: AgentConfig) -> None:
        self.logs = RunLogs(log_dir=str(config.log_dir), redirects=config.redirects)
        super().__init__(
            spec=spec,
            logs_specs=self.logs,
            start_method=config.start_method,
            shutdown_timeout=config.shutdown_timeout,  # type: ignore[arg-type]
        )
        self.config = config
        self.failed_stops = 0
        """Groups stopped because they failed: each restart torch made, and its last stop."""
        self.attempt: tuple[Any, ...] = ()
        self.attempt_seen = 0.0
        """The current attempt's workers, and when they were first seen running."""
        self.peers_looked = 0.0

    def _exit_barrier(self) -> None:
        """torch's agents wait at the end for every node of the group; after a recovery in place the lost nodes never
        come: the survivors wait for one another alone (the nodes `<run dir>/logs/in-place.json` names), so that the
        store's host outlives the others' last call to it."""
        from torch.distributed.elastic.utils.store import barrier

        said = self.in_place()
        try:
            nodes, at = int(said.get("nodes", 0)), float(said.get("time", 0))
        except (ValueError, TypeError):
            nodes = 0
        store = getattr(self, "_store", None)
        if not nodes or store is None:
            return super()._exit_barrier()
        try:
            barrier(store, nodes, key_prefix=f"launch/exit-after-in-place/{at}", barrier_timeout=300)
        except Exception as e:  # the job's work is done: a survivor that never came is told, not waited for
            logging.getLogger(__name__).warning("launch: exit barrier after a recovery in place: %s", e)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        workers = worker_group.workers
        if (attempt := tuple(w.id for w in workers)) != self.attempt:
            self.attempt, self.attempt_seen = attempt, time.time()
            STOPPED_BY_LAUNCHER.clear()  # an earlier attempt's: its pids may be reused
        # Before torch's poll, which would find the failure itself and give the others 30 s. A worker that fails
        # between this look and torch's (about 20 us of each 0.1 s interval, measured on 2 busy cores) is left to
        # torch's poll: its peers then get torch's 30 s, unless they end sooner on its SIGTERM.
        failed = {w.local_rank: code for w in workers if (code := _exit_code(w.id))}
        if failed:
            self._end_failed_group(workers, failed)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._list_failures(result, workers, failed)
        elif result.state == WorkerState.HEALTHY and (left := self.left_out(workers)):
            for worker in left:  # stopped, or too slow: the others went on without it
                print(
                    f"launch: rank {worker.global_rank} was left out of the job's recovery in place (it did not come "
                    "when its peers re-formed the group); killed, this node rejoins the job as a new one",
                    flush=True,
                )
                _kill(worker, "at once: left out of the job's recovery in place")
        elif result.state == WorkerState.HEALTHY and self.peer_failed():
            for worker in workers:
                if _running(worker.id):
                    _kill(worker, "at once: a rank of another node failed, and the job has no restart left")
        return result

    def _end_failed_group(self, workers: list[Worker], failed: dict[int, int]) -> None:
        """SIGTERM to the workers still running, `failed_grace` s for them to end, SIGKILL to those that did not,
        at once to those that cannot act on SIGTERM."""
        grace = self.config.failed_grace
        running = [w for w in workers if w.local_rank not in failed and _running(w.id)]
        logging.getLogger("torch.distributed.elastic").warning(
            "launch: rank(s) %s failed (exit code %s): the other ranks get %s s after SIGTERM",
            ", ".join(str(workers[r].global_rank) for r in failed),
            ", ".join(map(str, failed.values())),
            grace,
        )
        for worker in running:
            STOPPED_BY_LAUNCHER.add(worker.id)  # their end is no failure of their own
            _signal(worker.id, signal.SIGTERM)
        stuck = _gave_up(self.logs.error_files.values())
        for worker in running:
            if stuck:
                _kill(worker, "at once: a rank gave up waiting for it in a collective")
            elif _stopped(worker.id):
                _kill(worker, "at once: it is stopped (state T) and cannot act on SIGTERM")
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_running(w.id) for w in running):
            time.sleep(0.05)
        for worker in running:
            if _running(worker.id):
                _kill(worker, f"after {grace} s: it did not end on SIGTERM")

    def _list_failures(self, result: RunResult, workers: list[Worker], failed: dict[int, int]) -> None:
        """torch's poll of forked workers lists one failed rank, the first in rank order, which can now be one this
        agent stopped after the failure: the ranks that failed of themselves are listed too."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        for local_rank, code in failed.items():
            worker = workers[local_rank]
            if worker.global_rank not in result.failures:
                error_file = self.logs.error_files.get(local_rank, "")
                result.failures[worker.global_rank] = ProcessFailure(local_rank, worker.id, code, error_file)

    def left_out(self, workers: list[Worker]) -> list[Worker]:
        """This node's running workers that a recovery in place of this attempt left out (`<run dir>/logs/in-place.json`
        names the ranks lost; one that still runs is stopped or stuck, and no process group has it now). Looked at
        every `PEERS_EVERY` s, with `peer_failed`'s clock."""
        if time.time() - self.peers_looked < PEERS_EVERY:
            return []
        lost = self.in_place().get("lost")
        if not isinstance(lost, list):
            return []
        return [w for w in workers if w.global_rank in set(lost) and _running(w.id)]

    def in_place(self) -> dict[str, Any]:
        """What rank 0 recorded of this attempt's recovery in place (`<run dir>/logs/in-place.json`: the nodes that go
        on, the ranks lost), read as data; empty where none happened (or the record is damaged)."""
        import json

        record = self.config.run_dir / "logs" / IN_PLACE
        try:
            said = json.loads(record.read_text()) if record.stat().st_mtime >= self.attempt_seen else {}
        except (OSError, ValueError):
            return {}
        return said if isinstance(said, dict) else {}

    def peer_failed(self) -> bool:
        """A node's workers, all alive, of a job that cannot restart (no restart left to its agent), while another
        node's rank has failed: the job has ended, and torch's agent would not know it until a rendezvous call to the
        store timed out (its host gone: 2 min here), or ever (the store on this node, its rank hung outside a
        collective). Every `PEERS_EVERY` s the agent looks at the flag a failing rank touches (`lifecycle.FAILED_FLAG`,
        one file), and once it is newer than this attempt's workers and some rank's report there is a cause
        (`failures.peer_failure`), says so; the launcher then tells that cause, as on any node whose ranks stopped
        with it. With restarts left, torch's restart stops them instead. A job of one node: its agent sees its failed
        workers itself."""
        now = time.time()
        restarts_left = self.get_worker_group().spec.max_restarts - self.failed_stops
        if not self.config.watch_peers or restarts_left > 0 or now - self.peers_looked < PEERS_EVERY:
            return False
        self.peers_looked = now
        try:
            failed = (self.config.run_dir / "logs" / FAILED_FLAG).stat().st_mtime >= self.attempt_seen
        except OSError:
            return False
        return failed and peer_failure(self.config.run_dir, self.attempt_seen) is not None

    @prof
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # a node is waiting to join: the group restarts at a new size
            (self.config.run_dir / RESIZING).touch()
            self._shutdown(timeout=self.config.shutdown_timeout)  # type: ignore[arg-type]
        else:
            self.failed_stops += 1
            self._shutdown(timeout=self.config.failed_grace)  # type: ignore[arg-type]

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        for worker in self.get_worker_group().workers:
            if _running(worker.id) and _stopped(worker.id):
                _kill(worker, "at once: it is stopped (state T) and cannot act on SIGTERM")
        super()._shutdown(death_sig, timeout)


WAIT = os.WEXITED | os.WNOHANG | os.WNOWAIT
"""A look at a child's exit that leaves it to be reaped by whoever started it (torch)."""


def _running(pid: Any) -> bool:
    """Whether `pid` is a child of this process that has not ended (a stopped one has not)."""
    try:
        return pid is not None and os.waitid(os.P_PID, pid, WAIT) is None
    except ChildProcessError:  # not a child of this process, or reaped already
        return False


def _exit_code(pid: Any) -> int | None:
    """The exit code of child `pid` once it ended (-N: killed by signal N), read without reaping it; None while it
    runs, or where it is no child of this process any more."""
    try:
        ended = os.waitid(os.P_PID, pid, WAIT) if pid is not None else None
    except ChildProcessError:
        return None
    if ended is None:
        return None
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): a signal other than SIGKILL waits for it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _gave_up(error_files: Any) -> bool:
    """A failed rank's report says it gave up waiting in a collective (the runner's words for a collective timeout)."""
    for file in error_files:
        try:
            if GAVE_UP in Path(file).read_text():
                return True
        except OSError:
            continue
    return False


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill(worker: Worker, why: str) -> None:
    """SIGKILL a worker, said in the agent's log; its exit is then no failure of its own."""
    logging.getLogger("torch.distributed.elastic").warning(
        "launch: killing rank %s (pid %s) %s", worker.global_rank, worker.id, why
    )
    STOPPED_BY_LAUNCHER.add(worker.id)
    _signal(worker.id, signal.SIGKILL)


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
