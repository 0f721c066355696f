"""The parent side of a run: freeze and check the config, write `resolved.yaml`, start the workers.

cli (Hydra app) -> launch.run_job: freeze, derive, build the model on the meta device once, let strategy=auto
choose, check (strategy, resume), write resolved.yaml -> torch's elastic agent -> the workers (forked from here
on CPU, `python -m launcher.worker.main` on CUDA), each reading resolved.yaml; where the job runs: `launcher.clusters`
"""

from __future__ import annotations

import json
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

from launcher.base.durable import disk_error
from launcher.base.machine import loopback_interface, memory_available, usable_cpus, visible_cuda_devices
from launcher.clusters import detect, shaped
from launcher.config import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    ConfigError,
    Derived,
    derive,
    freeze,
    valid_micro_sizes,
    world_sizes,
)
from launcher.config.context import check_protocol, check_strategy
from launcher.config.identity import identity_hash
from launcher.config.known import check_keys
from launcher.parent.agent import agent_logs_to_file, failed_group_grace, preload
from launcher.parent.checks import check_built, check_resume
from launcher.parent.failures import joined_here, lost_node, oom_kills, peer_failure, rank_lines, secondary
from launcher.parent.model_checks import vocabulary
from launcher.parent.rendezvous import (
    LOOPBACK,
    JobFull,
    Rendezvous,
    cheap_event_names,
    reachable,
    refuse_spare_nodes,
    rendezvous,
)
from launcher.parent.run_id import claim_run
from launcher.parent.rundir import Ownership, remove_made
from launcher.worker.lifecycle import (
    DUMP_SIGNAL,
    FAILURE_DIR_ENV,
    FLIGHT_RECORDER,
    NODE_ID_ENV,
    STOP_REPEAT_GRACE,
    STOP_SIGNALS,
    flight_recorder_env,
)
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
    """The strategy's: what forked workers are given loaded (`launcher.parent.agent.preload`)."""


def prepare(cfg: DictConfig, run_dir: Path, job: dict[str, Any] | None = None) -> Prepared:
    """Check the composed config, claim the run directory, and write `<run_dir>/resolved.yaml`.

    Every check comes before the claim, and the claim before the first write: refused input writes nothing.
    `job` carries what Hydra knows of this job (its config-group choices, its overrides, its place in a sweep);
    it is recorded in the frozen config and names the job's wandb group and run.
    """
    from launcher.models.meta import build_on_meta, measure
    from launcher.plan.commands import choose, choose_micro, is_auto, planned_peak
    from launcher.worker.adapt import oom_restarts, read_adapted

    frozen = shaped(freeze(cfg), os.environ, (job or {}).get("overrides", []))  # a cluster's nodes and gpus
    cuda = visible_cuda_devices()
    derived = derive(frozen, cuda)
    if derived.micro_auto:  # checked and planned (strategy=auto) at one sample; chosen once the strategy is
        frozen.batch.micro_size = 1
    if forks_workers(derived, frozen.trainer):
        import torch

        # Not one OpenMP thread in this process before the fork: GNU OpenMP's pool does not survive it (a forked
        # worker would wait forever in its first parallel region); the workers size their own (`after_fork`).
        torch.set_num_threads(1)
    check_keys(frozen)
    model = build_on_meta(frozen.model)  # once: every check below reads this one
    no_grad = check_built(frozen, model)
    if is_auto(frozen):  # strategy=auto: the planner's pick replaces it before anything else reads the config
        name, frozen = choose(frozen, derived, model)
        if job and "choices" in job:
            job = {**job, "choices": {**job["choices"], "strategy": name}}  # record what runs, for reports and names
    check_protocol(frozen)  # before the planner reads the strategy (a user's, written to an older protocol)
    read_adapted(run_dir)  # the run directory's record is data: a damaged one is refused, whatever the micro-batch
    if derived.micro_auto:  # batch.micro_size=auto: the largest that fits, or what an out-of-memory error left
        worlds = world_sizes(f"{derived.min_nodes}:{derived.nodes}", derived.gpus)
        valid = valid_micro_sizes(int(frozen.batch.global_size), worlds)
        frozen, derived = choose_micro(frozen, derived, model, read_adapted(run_dir, valid))
    rdzv = rendezvous(frozen, derived, os.environ)
    resolved: dict[str, Any] = OmegaConf.to_container(frozen)  # type: ignore[assignment]
    size = measure(model)
    resolved["derived"] = {
        **derived.as_dict(),
        "model": size.as_dict(),
        "plan_peak_bytes": planned_peak(frozen, derived, size),
        "vocab_size": vocabulary(model),  # the workers check user data's token ids against it
        "no_grad": no_grad,  # parameters without a gradient from the first micro-batch: the strategies' RunContext
        "cluster": rdzv.job.cluster,
        "shared_run_dir": rdzv.job.shared_run_dir,  # the nodes' ranks check that they see one run directory
    }
    resolved["job"] = {**(job or {}), "config_hash": identity_hash(frozen, cfg)}
    _name_logger_run(resolved)
    frozen = OmegaConf.create(resolved)
    requirements = check_strategy(frozen, model)
    found = check_resume(frozen, run_dir, model)
    ownership = claim_run(frozen, run_dir, found, rdzv.run_id if derived.nodes > 1 else None)  # and its run id
    path = run_dir / "resolved.yaml"
    # Atomic: in a SLURM allocation every node's launcher writes the same file on a shared disk.
    tmp = run_dir / f".resolved.{os.getpid()}.yaml"
    OmegaConf.save(frozen, tmp)
    os.replace(tmp, path)
    restarts = oom_restarts(frozen, derived) + int(frozen.trainer.max_restarts)
    return Prepared(path, derived, rdzv, ownership, restarts, requirements)


def check_job(cfg: DictConfig) -> None:
    """The checks `prepare` makes, for a config composed outside of a job: a sweep's jobs, each checked before the
    first one starts. ConfigError (one line) for the first that fails; nothing is written, nothing printed."""
    import contextlib
    import io

    from launcher.models.meta import build_on_meta
    from launcher.plan.commands import choose, choose_micro, is_auto

    with contextlib.redirect_stdout(io.StringIO()):  # strategy=auto's table is for the job itself to print
        frozen = shaped(freeze(cfg), os.environ, [])
        derived = derive(frozen, visible_cuda_devices())
        if derived.micro_auto:
            frozen.batch.micro_size = 1
        check_keys(frozen)
        model = build_on_meta(frozen.model)
        check_built(frozen, model)
        if is_auto(frozen):
            _, frozen = choose(frozen, derived, model)
        check_protocol(frozen)
        if derived.micro_auto:
            frozen, derived = choose_micro(frozen, derived, model, None)
        check_strategy(OmegaConf.merge(frozen, {"derived": derived.as_dict()}), model)


def _name_logger_run(resolved: dict[str, Any]) -> None:
    """In a sweep: one group per sweep (a search: per study) in each logger (wandb's group, MLflow's parent run,
    TensorBoard's folder), one run per job, unless the user named them."""
    loggers, job = resolved["logger"], resolved["job"]
    if not job.get("sweep_dir") or not isinstance(loggers, dict):
        return
    group = resolved["sweep"]["study"] or Path(job["sweep_dir"]).name
    for logger in loggers.values():
        for key, value in (("group", group), ("name", f"{group}-{job['num']}")):  # its overrides: in the logged config
            if isinstance(logger, dict) and key in logger and logger[key] is None:
                logger[key] = value


def describe(cfg: DictConfig, derived: Derived, rdzv: Rendezvous, run_dir: Path) -> str:
    b = cfg.batch
    where = f" via rendezvous {rdzv.endpoint} (id {rdzv.run_id})" if derived.nodes > 1 else ""
    if rdzv.job.cluster != "local":
        where += f", node {rdzv.job.node_rank} of a {rdzv.job.cluster} job"
    nodes, world = f"{derived.nodes} node(s)", f"world size {derived.world_size}"
    micro = b.global_size // (derived.accumulation * derived.world_size)  # batch.micro_size=auto: the planner's
    if derived.min_nodes < derived.nodes:  # elastic: accumulation follows the world size the group starts with
        nodes = f"{derived.min_nodes} to {derived.nodes} nodes (elastic)"
        world = f"world size {derived.min_nodes * derived.gpus} to {derived.world_size}"
    return (
        f"launch: {nodes} x {derived.gpus} {derived.device} worker(s) = {world}{where}; "
        f"batch: micro {micro}{' (auto)' if derived.micro_auto else ''} x accumulation {derived.accumulation} "
        f"x world {derived.world_size} = global {b.global_size}; run dir {run_dir}"
    )


def hydra_job() -> tuple[Path, dict[str, Any]]:
    """The job's output directory and what Hydra knows of it (choices, and its sweep if any)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    job: dict[str, Any] = {
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        "overrides": list(hc.overrides.task),
    }
    if hc.mode == RunMode.MULTIRUN:
        job |= {"sweep_dir": str(Path(hc.sweep.dir).resolve()), "num": hc.job.num}
    return Path(hc.runtime.output_dir), job


@dataclass(frozen=True)
class Outcome:
    code: int
    """The launcher's exit code: 0 finished, 1 failed, 2 refused before start, 128 + N stopped by signal N."""
    reason: str = ""
    """One line: why it did not finish (printed as `launch: error: ...`), empty when it did."""
    more: tuple[str, ...] = ()
    """The other failing ranks' lines, printed after the reason."""


OUTCOME = "outcome.json"
"""A sweep job's outcome in its folder, for the sweep's report: code, reason, seconds."""


def run_job(cfg: DictConfig) -> int | dict[str, Any]:
    """One run: the task function of the Hydra app (called once per job in a multirun, once per node on SLURM).

    In a sweep a job that fails does not end the sweep: its outcome is recorded for the report, which lists every
    job and makes the sweep exit non-zero if any failed; a search's trial returns it, with its state and objective.
    """
    started = time.monotonic()
    run_dir, job = hydra_job()
    outcome = _run(cfg, run_dir, job)
    if outcome.reason and not outcome.code >= 128:  # a stop already said where its checkpoint is
        for line in (outcome.reason, *outcome.more):
            print(f"launch: error: {line}", file=sys.stderr, flush=True)
    if "sweep_dir" not in job:
        return outcome.code
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"code": outcome.code, "reason": outcome.reason, "seconds": round(time.monotonic() - started, 1),
              "strategy": job["choices"].get("strategy"), "overrides": job["overrides"]}  # fmt: skip
    from launcher.search.objective import trial_outcome

    record |= trial_outcome(cfg, run_dir, outcome.code, outcome.reason)  # {} outside a search
    (run_dir / OUTCOME).write_text(json.dumps(record))
    return record if "state" in record else 0


def _run(cfg: DictConfig, run_dir: Path, job: dict[str, Any]) -> Outcome:
    try:
        prepared = prepare(cfg, run_dir, job)
    except (ConfigError, OSError) as e:
        if "sweep_dir" not in job:
            remove_made(run_dir)  # a refused run leaves nothing behind, and removes nothing it did not make
        if isinstance(e, OSError):  # the run directory cannot be written: a full disk, a read-only mount
            return Outcome(EXIT_FAILED, disk_error(e, run_dir))
        return Outcome(EXIT_BAD_INPUT, str(e))
    print(describe(cfg, prepared.derived, prepared.rdzv, run_dir), flush=True)
    try:
        return start_workers(prepared, cfg.trainer, run_dir)
    finally:
        prepared.ownership.release()


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


def forks_workers(derived: Derived, trainer: DictConfig) -> bool:
    """CPU workers are forked from this process, which has torch and the run's modules imported already
    (`trainer.fork_workers`); CUDA ones start afresh: a CUDA driver touched here (`device=auto` asks it) is unusable
    in a forked child."""
    return derived.device == "cpu" and bool(trainer.fork_workers)


def start_workers(prepared: Prepared, trainer: DictConfig, run_dir: Path) -> Outcome:
    """Start `gpus` workers on this node through torch's elastic agent and wait for them."""
    resolved, derived, rdzv = prepared.resolved, prepared.derived, prepared.rdzv
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _worker_environment(derived, rdzv, run_dir)
    agent_logs_to_file(run_dir)
    cheap_event_names()
    refuse_spare_nodes()
    forked = forks_workers(derived, trainer)
    if forked:
        preload(prepared.requirements, derived.device)
    quiet = {rank: Std.ALL for rank in range(1, derived.gpus)}  # rank 0 talks to the terminal
    config = LaunchConfig(
        min_nodes=derived.min_nodes,  # nodes=MIN:MAX: the group restarts at the new size when a node leaves or joins
        max_nodes=derived.nodes,
        nproc_per_node=derived.gpus,
        run_id=rdzv.run_id,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=rdzv.configs,
        local_addr=rdzv.local_addr,
        max_restarts=prepared.restarts,
        # The agent passes these on to the workers, which finish the step and checkpoint (SIGUSR2: SLURM's warning).
        signals_to_handle=",".join(s.name for s in STOP_SIGNALS),
        shutdown_timeout=trainer.stop_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=quiet),
        start_method="fork" if forked else "spawn",
    )
    failed_group_grace(min(trainer.stop_timeout, STOP_REPEAT_GRACE), trainer.stop_timeout, run_dir)
    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, DUMP_SIGNAL)}
    signal.signal(DUMP_SIGNAL, _ask_workers)
    oom_before, (_, available) = oom_kills(), memory_available()
    spare = Path(tempfile.mkdtemp(prefix="launch-failures-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    os.environ[FAILURE_DIR_ENV] = str(spare)  # failure reports that cannot be written into the run directory
    started = time.time()

    def lost() -> str | None:  # another node's rank failed, or the group had joined and another node went away
        if derived.nodes == 1:
            return None
        if cause := peer_failure(run_dir, started - 1):  # the cause, not a node gone because of it
            return cause
        store_gone = None if reachable(rdzv.endpoint) else rdzv.endpoint  # its store: on the node that went away?
        elastic = derived.min_nodes < derived.nodes
        return lost_node(run_dir, started - 1, derived.world_size, os.environ[NODE_ID_ENV], store_gone, elastic)

    try:
        if forked:
            from launcher.worker import main as worker

            elastic_launch(config, worker.forked)(str(resolved))
        else:
            elastic_launch(config, sys.executable)("-u", "-m", "launcher.worker.main", str(resolved))
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
