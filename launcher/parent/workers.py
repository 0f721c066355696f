"""The workers of this node: started through torch's elastic agent (forked from this process on CPU, `python -m
launcher.worker.main` on CUDA) with what the launcher set up for them, waited for, and how they ended told in one
line: finished, a rank's failure (its cause, not its echoes), a node lost, a rendezvous that never met, a stop signal
(where its checkpoint is)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.machine import loopback_interface, memory_available, usable_cpus
from launcher.base.process import DUMP_SIGNAL, STOP_REPEAT_GRACE, STOP_SIGNALS, release_collector
from launcher.base.run_files import FAILURE_DIR_ENV, FLIGHT_RECORDER, NODE_ID_ENV, flight_recorder_env
from launcher.clusters import detect
from launcher.config import EXIT_FAILED, Derived
from launcher.elastic.failures import awaited_cause, joined_here, lost_node, oom_kills, rank_lines, secondary
from launcher.elastic.rendezvous import LOOPBACK, JobFull, Rendezvous, reachable, refuse_spare_nodes
from launcher.parent.rundir import Ownership
from launcher.recovery.leftovers import remove_left_over
from launcher.recovery.node import memory_tier
from launcher.recovery.shm import SHM
from strategies.declarations import Requirements


@dataclass(frozen=True)
class Prepared:
    resolved: Path
    """`<run dir>/resolved.yaml`, the only thing workers read."""
    derived: Derived
    rdzv: Rendezvous
    ownership: Ownership
    """This launch's claim on the run directory, held until the workers are done."""
    restarts: int
    """The elastic agent's restarts: trainer.max_restarts, and one per halving batch.micro_size=auto has left."""
    requirements: Requirements
    """The strategy's: what forked workers are given loaded (`launcher.elastic.agent.preload`)."""


@dataclass(frozen=True)
class Outcome:
    code: int
    """The launcher's exit code: 0 finished, 1 failed, 2 refused before start, 128 + N stopped by signal N."""
    reason: str = ""
    """One line: why it did not finish (printed as `launch: error: ...`), empty when it did."""
    more: tuple[str, ...] = ()
    """The other failing ranks' lines, printed after the reason."""


def _worker_environment(derived: Derived, rdzv: Rendezvous, run_dir: Path) -> None:
    # One BLAS thread pool per worker would oversubscribe the cores: split them between workers.
    if derived.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // derived.gpus))
    # DeepSpeed would guess its accelerator (and warn about it) in every worker; on CPU we know it.
    if derived.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Restarted workers must not read the dead attempt's addresses from a shared store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if rdzv.local_addr == LOOPBACK:  # one node: the process group's sockets on loopback too, unless the user chose
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    # Workers end themselves when this process is gone, from their first instruction (launcher.worker.main).
    os.environ["LAUNCH_PARENT_PID"] = str(os.getpid())
    os.environ[NODE_ID_ENV] = f"{socket.gethostname()}:{os.getpid()}:{time.time():.6f}"  # names this node's ranks
    if derived.device == "cuda":  # NCCL's flight recorder: each rank's last collectives, dumped on a timeout
        recorder = flight_recorder_env(run_dir, dict(os.environ))
        if recorder:
            (run_dir / FLIGHT_RECORDER).mkdir(parents=True, exist_ok=True)
        os.environ.update(recorder)


def _ask_workers(signum: int, _frame: Any) -> None:
    """SIGUSR1 to the launcher goes on to each of its workers: every rank writes its phase and its Python stacks
    (`launcher.worker.lifecycle`)."""
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid == me and (proc / "comm").read_text().startswith(
                "launch-rank"
            ):  # launcher.worker.lifecycle.name_process
                os.kill(int(proc.name), signum)
        except (OSError, ValueError, IndexError):  # not a process, or one that ended meanwhile
            continue


def start_workers(prepared: Prepared, trainer: DictConfig, run_dir: Path) -> Outcome:
    """Start `gpus` workers on this node through the launcher's elastic agent and wait for them."""
    resolved, derived, rdzv = prepared.resolved, prepared.derived, prepared.rdzv
    from torch.distributed.elastic.multiprocessing import SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from launcher.adapters.torch_private import cheap_event_names, check_elastic
    from launcher.elastic.agent import AgentConfig, agent_logs_to_file, preload, run_agent
    from strategies.checked import LibraryChanged

    try:  # the names of torch's the agent and the rendezvous rely on, before anything starts
        check_elastic()
        cheap_event_names()
        refuse_spare_nodes()
    except LibraryChanged as e:
        return Outcome(EXIT_FAILED, str(e))
    if removed := remove_left_over():  # the tier folders of this host's launchers that were killed
        print(removed, flush=True)
    _worker_environment(derived, rdzv, run_dir)
    tier = memory_tier(resolved, os.environ[NODE_ID_ENV])  # this node's folder in shared memory, removed at the end
    agent_logs_to_file(run_dir)
    forked = derived.forks_workers(trainer)
    if forked:
        preload(prepared.requirements, derived.device)
    release_collector()  # what the launcher imported and built, frozen before the workers fork from it
    config = AgentConfig(
        min_nodes=derived.min_nodes,  # nodes=MIN:MAX: the group restarts at the new size when a node leaves or joins
        max_nodes=derived.nodes,
        nproc_per_node=derived.gpus,
        rdzv=rdzv,
        max_restarts=prepared.restarts,
        # The agent passes these on to the workers, which finish the step and checkpoint (SIGUSR2: SLURM's warning).
        signals_to_handle=",".join(s.name for s in STOP_SIGNALS),
        shutdown_timeout=trainer.stop_timeout,
        failed_grace=min(trainer.stop_timeout, STOP_REPEAT_GRACE),
        log_dir=run_dir / "logs",
        redirects={rank: Std.ALL for rank in range(1, derived.gpus)},  # rank 0 talks to the terminal
        start_method="fork" if forked else "spawn",
        run_dir=run_dir,
        watch_peers=derived.nodes > 1,
    )
    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, DUMP_SIGNAL)}
    signal.signal(DUMP_SIGNAL, _ask_workers)
    oom_before, (_, available) = oom_kills(), memory_available()
    spare = failure_folder()
    os.environ[FAILURE_DIR_ENV] = str(spare)  # failure reports that cannot be written into the run directory
    started = time.time()

    def lost() -> str | None:  # another node's rank failed, or the group had joined and another node went away
        if derived.nodes == 1:
            return None
        if cause := awaited_cause(run_dir, started - 1):  # the cause, not a node gone because of it
            return cause
        store_gone = None if reachable(rdzv.endpoint) else rdzv.endpoint  # its store: on the node that went away?
        elastic = derived.min_nodes < derived.nodes
        return lost_node(run_dir, started - 1, derived.world_size, os.environ[NODE_ID_ENV], store_gone, elastic)

    try:
        if forked:
            from launcher.worker import main as worker

            run_agent(config, worker.forked, str(resolved))
        else:
            run_agent(config, sys.executable, "-u", "-m", "launcher.worker.main", str(resolved))
    except SignalException as e:
        return _stopped(e.sigval, run_dir, previous, trainer)
    except JobFull as e:
        return Outcome(EXIT_FAILED, str(e))
    except RendezvousError as e:
        if gone := lost():
            return Outcome(EXIT_FAILED, gone)
        if joined_here(run_dir, started - 1, os.environ[NODE_ID_ENV]):
            return Outcome(
                EXIT_FAILED,
                f"rendezvous {rdzv.endpoint} (id {rdzv.run_id}) stopped answering once the job ran "
                f"({type(e).__name__}): the node that hosts it ended or cannot be reached (each node's lines are in "
                "<run dir>/logs/agent.log); start launch again on every node to resume from the last checkpoint",
            )
        return Outcome(
            EXIT_FAILED,
            f"the {derived.nodes} nodes did not all join rendezvous {rdzv.endpoint} (id {rdzv.run_id}) "
            f"within rdzv.join_timeout={rdzv.configs['join_timeout']} s ({type(e).__name__}); "
            "start launch on every node with the same rdzv.endpoint and rdzv.id",
        )
    except ChildFailedError as e:
        from launcher.plan.commands import memory_advice

        lines = rank_lines(e, oom_before, lambda: memory_advice(OmegaConf.load(resolved), available), spare, run_dir)
        causes = [line for line in lines if not secondary(line)]
        if not causes and (gone := lost()):
            return Outcome(EXIT_FAILED, gone)  # this node's ranks only lost their peers
        # The cause, not its echoes: the ranks that stopped because of it are no failures of their own.
        told = causes or lines[:1]
        return Outcome(EXIT_FAILED, told[0], tuple(told[1:]))
    except Exception as e:  # the agent's own store gone (it was on the node that went away)
        if gone := lost():
            logging.getLogger("torch.distributed.elastic").warning("the agent failed: %r", e)
            return Outcome(EXIT_FAILED, gone)
        raise
    finally:
        shutil.rmtree(spare, ignore_errors=True)
        if tier is not None:  # the job ended, was stopped or failed for good: its memory tier goes with it
            shutil.rmtree(tier, ignore_errors=True)
        for sig, handler in previous.items():  # the agent leaves its own handlers behind
            signal.signal(sig, handler)
    return Outcome(0)


def _stopped(sig: signal.Signals, run_dir: Path, previous: dict[signal.Signals, Any], trainer: DictConfig) -> Outcome:
    """The workers saved and stopped on a signal: say where the checkpoint is and how to go on."""
    from launcher.base.storage import checkpoints_of
    from launcher.checkpoint.format import latest

    saved = latest(checkpoints_of(trainer, run_dir))  # <run dir>/checkpoints, or trainer.checkpoint_dir
    again = saved if trainer.get("checkpoint_dir") else run_dir  # resume=<run dir> takes its newest
    where = f"checkpoint {saved}; continue with the same command plus resume={again}"
    print(
        f"launch: stopped by {sig.name}: {where if saved else 'no checkpoint was saved'}", file=sys.stderr, flush=True
    )
    detect(os.environ).stopped(sig, previous.get(sig))  # SLURM: submitit's handler requeues the job
    return Outcome(128 + sig, f"stopped by {sig.name}")


def failure_folder() -> Path:
    """A folder of this launcher's own for failure reports the run directory cannot hold: in /dev/shm or $LAUNCH_SHM
    (memory, where a disk is full; `launcher.recovery.shm.SHM`), named by this process's id. Those of launchers of this
    machine that no longer run (killed before they could remove theirs) are removed first, where empty: a report left
    in one was never read."""
    where = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    for stale in where.glob("launch-failures-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                stale.rmdir()  # only where empty: a report in it stays
            except OSError:
                pass
    return Path(tempfile.mkdtemp(prefix=f"launch-failures-{os.getpid()}-", dir=where))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
