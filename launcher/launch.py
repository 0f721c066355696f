"""The parent side of a run: freeze and check the config, write `resolved.yaml`, start the workers.

    cli (Hydra app) -> launch.run_job: freeze, derive, build the model on the meta device once, let strategy=auto
    choose, check (strategy, resume), write resolved.yaml -> torch's elastic agent -> `python -m launcher.worker`

The workers are started as a command, never imported from here: launch sits above the worker, the runner and
the strategies, and below the CLI; the planner (`launcher.plan`), the checks and the machine probes sit below it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.checks import check_resume, check_strategy
from launcher.config import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, Derived, derive, freeze
from launcher.lifecycle import STOP_SIGNALS
from launcher.machine import usable_cpus, visible_cuda_devices
from launcher.rendezvous import Rendezvous, rendezvous


def prepare(cfg: DictConfig, run_dir: Path, job: dict[str, Any] | None = None) -> tuple[Path, Derived, Rendezvous]:
    """Check the composed config and write `<run_dir>/resolved.yaml`, the only thing workers read.

    `job` carries what Hydra knows of this job (its config-group choices, its place in a sweep);
    it is recorded in the frozen config and names the job's wandb group and run.
    """
    from launcher.meta import build_on_meta, measure
    from launcher.plan.commands import choose, is_auto

    frozen = freeze(cfg)
    cuda = visible_cuda_devices()
    derived = derive(frozen, cuda)
    model = build_on_meta(frozen.model)  # once: every check below reads this one
    if is_auto(frozen):  # strategy=auto: the planner's pick replaces it before anything else reads the config
        name, frozen = choose(frozen, derived, model)
        if job and "choices" in job:
            job = {**job, "choices": {**job["choices"], "strategy": name}}  # record what runs, for reports and names
    rdzv = rendezvous(frozen, derived, os.environ)
    resolved: dict[str, Any] = OmegaConf.to_container(frozen)  # type: ignore[assignment]
    resolved["derived"] = {**derived.as_dict(), "model": measure(model).as_dict()}
    resolved["job"] = job or {}
    _name_logger_run(resolved)
    frozen = OmegaConf.create(resolved)
    check_strategy(frozen, model)
    found = check_resume(frozen, run_dir, model)
    frozen.job.resume_from = str(found) if found else None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved.yaml"
    # Atomic: in a SLURM allocation every node's launcher writes the same file on a shared disk.
    tmp = run_dir / f".resolved.{os.getpid()}.yaml"
    OmegaConf.save(frozen, tmp)
    os.replace(tmp, path)
    return path, derived, rdzv


def _name_logger_run(resolved: dict[str, Any]) -> None:
    """In a sweep: one wandb group per sweep, one run per job, unless the user named them."""
    logger, job = resolved["logger"], resolved["job"]
    if job.get("sweep_dir") and isinstance(logger, dict):
        if "group" in logger and logger["group"] is None:
            logger["group"] = Path(job["sweep_dir"]).name
        if "name" in logger and logger["name"] is None:
            logger["name"] = f"{Path(job['sweep_dir']).name}-{job['num']}"  # its overrides are in the logged config


def describe(cfg: DictConfig, derived: Derived, rdzv: Rendezvous, run_dir: Path) -> str:
    b = cfg.batch
    where = f" via rendezvous {rdzv.endpoint} (id {rdzv.run_id})" if derived.nodes > 1 else ""
    return (
        f"launch: {derived.nodes} node(s) x {derived.gpus} {derived.device} worker(s) "
        f"= world size {derived.world_size}{where}; "
        f"batch: micro {b.micro_size} x accumulation {derived.accumulation} x world {derived.world_size} "
        f"= global {b.global_size}; run dir {run_dir}"
    )


def hydra_job() -> tuple[Path, dict[str, Any]]:
    """The job's output directory and what Hydra knows of it (choices, and its sweep if any)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    job: dict[str, Any] = {"choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}}
    if hc.mode == RunMode.MULTIRUN:
        job |= {"sweep_dir": str(Path(hc.sweep.dir).resolve()), "num": hc.job.num, "overrides": hc.job.override_dirname}
    return Path(hc.runtime.output_dir), job


def run_job(cfg: DictConfig) -> int:
    """One run: the task function of the Hydra app (called once per job in a multirun, once per node on SLURM)."""
    run_dir, job = hydra_job()
    try:
        path, derived, rdzv = prepare(cfg, run_dir, job)
    except ConfigError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(describe(cfg, derived, rdzv, run_dir), flush=True)
    return start_workers(path, derived, rdzv, cfg.trainer, run_dir)


def _worker_environment(derived: Derived) -> None:
    # One BLAS thread pool per worker would oversubscribe the cores: split them between workers.
    if derived.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // derived.gpus))
    # DeepSpeed would guess its accelerator (and warn about it) in every worker; on CPU we know it.
    if derived.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Restarted workers must not read the dead attempt's addresses from a shared store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def start_workers(resolved: Path, derived: Derived, rdzv: Rendezvous, trainer: DictConfig, run_dir: Path) -> int:
    """Start `gpus` workers on this node through torch's elastic agent and wait for them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _worker_environment(derived)
    quiet = {rank: Std.ALL for rank in range(1, derived.gpus)}  # rank 0 talks to the terminal
    config = LaunchConfig(
        min_nodes=derived.nodes,
        max_nodes=derived.nodes,
        nproc_per_node=derived.gpus,
        run_id=rdzv.run_id,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=rdzv.configs,
        max_restarts=trainer.max_restarts,
        # The agent passes these on to the workers, which finish the step and checkpoint (SIGUSR2: SLURM's warning).
        signals_to_handle=",".join(s.name for s in STOP_SIGNALS),
        shutdown_timeout=trainer.stop_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=quiet),
    )
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "launcher.worker", str(resolved))
    except SignalException as e:
        return _stopped(e.sigval, run_dir, previous)
    except RendezvousError as e:
        print(
            f"launch: error: the {derived.nodes} nodes did not all join rendezvous {rdzv.endpoint} (id {rdzv.run_id}) "
            f"within rdzv.join_timeout={rdzv.configs['join_timeout']} s ({type(e).__name__}); "
            "start launch on every node "
            "with the same rdzv.endpoint and rdzv.id",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        print(
            f"launch: error: rank {rank} failed: {_summary(message, failure.exitcode)} (logs: {run_dir / 'logs'})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():  # the agent leaves its own handlers behind
            signal.signal(sig, handler)
    return 0


def _stopped(sig: signal.Signals, run_dir: Path, previous: dict[signal.Signals, Any]) -> int:
    """The workers saved and stopped on a signal: say where the checkpoint is and how to go on."""
    from launcher.checkpoint import latest

    saved = latest(run_dir / "checkpoints")
    where = (
        f"checkpoint {saved}; continue with the same command plus resume={run_dir}"
        if saved
        else "no checkpoint was saved"
    )
    print(f"launch: stopped by {sig.name}: {where}", file=sys.stderr, flush=True)
    handler = previous.get(sig)
    if callable(handler):  # e.g. submitit's SIGUSR2 handler, which requeues the SLURM job
        handler(sig, None)
    return 128 + sig


def _summary(message: object, exitcode: int) -> str:
    """The line of a worker's error that names the exception, or its exit code (a signal is negative)."""
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if named or lines:
        return (named or lines)[-1]
    return f"exit code {exitcode}" if exitcode >= 0 else f"killed by signal {-exitcode}"
