"""The parent side of a run: validate, freeze the config, start the workers through the elastic agent."""

from __future__ import annotations

import os
import re
import signal
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError, Derived, derive
from launcher.lifecycle import STOP_SIGNALS

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(cfg: DictConfig, run_dir: Path, job: dict[str, Any] | None = None) -> tuple[Path, Derived, Rendezvous]:
    """Validate the composed config and write `<run_dir>/resolved.yaml`, the only thing workers read.

    `job` carries what Hydra knows of this job (its config-group choices, its place in a sweep);
    it is recorded in the frozen config and names the job's wandb group and run.
    """
    from launcher.plan import choose, is_auto

    if is_auto(cfg):  # strategy=auto: the planner's pick replaces it before anything else reads the config
        name, cfg = choose(cfg, visible_cuda_devices())
        if job and "choices" in job:
            job = {**job, "choices": {**job["choices"], "strategy": name}}  # record what runs, for reports and names
    derived = derive(cfg, visible_cuda_devices())
    rdzv = rendezvous(cfg, derived, os.environ)
    resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[assignment]
    resolved["derived"] = derived.as_dict()
    resolved["job"] = job or {}
    resolved["job"]["resume_from"] = _resume_from(cfg, run_dir)
    _name_logger_run(resolved)
    frozen = OmegaConf.create(resolved)
    check_strategy(frozen)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved.yaml"
    # Atomic: in a SLURM allocation every node's launcher writes the same file on a shared disk.
    tmp = run_dir / f".resolved.{os.getpid()}.yaml"
    OmegaConf.save(frozen, tmp)
    os.replace(tmp, path)
    return path, derived, rdzv


def check_strategy(frozen: DictConfig) -> None:
    """The strategy's own checks, from rank 0's view of a frozen config, before any worker starts."""
    from hydra.utils import instantiate

    from launcher.worker import context

    strategy = instantiate(frozen.strategy)
    try:
        strategy.check(context(frozen, 0, 0, frozen.derived.world_size), OmegaConf.to_container(frozen.model))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _resume_from(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint `resume=` names, checked against the model before any worker starts."""
    from hydra.utils import instantiate

    from launcher.checkpoint import CheckpointError, check_fits, find_resume

    try:
        found = find_resume(cfg.resume, run_dir)
        if found is not None:
            import torch

            try:
                with torch.device("meta"):
                    model = instantiate(cfg.model)
            except Exception:  # a model that cannot be built on the meta device: the workers check it on load
                model = None
            if model is not None:
                check_fits(found, model)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e
    if cfg.resume == "auto":
        print(f"launch: resume=auto: {f'resuming from {found}' if found else 'no earlier checkpoint found, starting fresh'}")
    return str(found) if found else None


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
        f"launch: {derived.nodes} node(s) x {derived.gpus} {derived.device} worker(s) = world size {derived.world_size}{where}; "
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


# --------------------------------------------------------------------------------------------
# Rendezvous: where the nodes of one job meet. One node binds to loopback; several need a shared
# endpoint and id, given by the user or read from the SLURM allocation the job runs in.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str
    run_id: str
    backend: str
    configs: dict[str, Any]


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list: "gpu[01-03,07],cpu1" -> gpu01, gpu02, gpu03, gpu07, cpu1."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def rendezvous(cfg: DictConfig, derived: Derived, env: Mapping[str, str]) -> Rendezvous:
    """Resolve the rendezvous of this job; raise ConfigError on settings that could only stall."""
    r = cfg.rdzv
    if r.backend not in ("c10d", "static"):
        raise ConfigError(f"rdzv.backend={r.backend} is not supported; use c10d or static")
    configs: dict[str, Any] = {"join_timeout": int(r.join_timeout)}
    endpoint, run_id, node_rank = r.endpoint, r.id, r.node_rank
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env:
        slurm_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
        if slurm_nodes != derived.nodes:
            raise ConfigError(f"nodes={derived.nodes} but this SLURM allocation has {slurm_nodes} node(s); use nodes={slurm_nodes}")
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
        if tasks and tasks.split("(")[0] != "1":
            raise ConfigError(
                f"SLURM runs {tasks} tasks per node, but each node needs exactly one launcher (it starts the gpus={derived.gpus} "
                "workers itself); set hydra.launcher.tasks_per_node=1"
            )
        gpus_on_node = env.get("SLURM_GPUS_ON_NODE")
        if derived.device == "cuda" and gpus_on_node and int(gpus_on_node) < derived.gpus:
            raise ConfigError(f"gpus={derived.gpus} but SLURM gave this node {gpus_on_node} GPU(s); use gpus={gpus_on_node} or ask SLURM for more")
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        port = r.port if r.port is not None else 20000 + int(re.sub(r"\D", "", env["SLURM_JOB_ID"]) or 0) % 20000
        endpoint = endpoint or f"{hosts[0]}:{port}"
        # A requeued job must not meet the previous attempt's rendezvous.
        run_id = run_id or f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_RESTART_COUNT', '0')}"
        node_rank = node_rank if node_rank is not None else int(env.get("SLURM_NODEID", "0"))
    elif derived.nodes > 1 and not (endpoint and run_id):
        raise ConfigError(
            f"nodes={derived.nodes} needs rdzv.endpoint=HOST:PORT and rdzv.id=NAME, the same on every node "
            "(or run inside a SLURM allocation)"
        )
    if r.backend == "static":
        if derived.nodes > 1 and node_rank is None:
            raise ConfigError("rdzv.backend=static needs rdzv.node_rank=N on each node (or SLURM_NODEID)")
        configs["rank"] = node_rank or 0
    return Rendezvous(endpoint or "127.0.0.1:0", run_id or uuid.uuid4().hex[:12], r.backend, configs)


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota.

    os.cpu_count() counts the host's CPUs; inside a container limited to a few, thread pools
    sized by it oversubscribe the cores many times over.
    """
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    v2, v1 = Path("/sys/fs/cgroup/cpu.max"), Path("/sys/fs/cgroup/cpu")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]  # "max 100000" when unlimited
        else:
            quota, period = ((v1 / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))  # -1: unlimited
        if quota not in ("max", "-1"):
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count


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
            f"within rdzv.join_timeout={rdzv.configs['join_timeout']} s ({type(e).__name__}); start launch on every node "
            "with the same rdzv.endpoint and rdzv.id",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        print(f"launch: error: rank {rank} failed: {_summary(message, failure.exitcode)} (logs: {run_dir / 'logs'})",
              file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():  # the agent leaves its own handlers behind
            signal.signal(sig, handler)
    return 0


def _stopped(sig: signal.Signals, run_dir: Path, previous: dict[signal.Signals, Any]) -> int:
    """The workers saved and stopped on a signal: say where the checkpoint is and how to go on."""
    from launcher.checkpoint import latest

    saved = latest(run_dir / "checkpoints")
    where = f"checkpoint {saved}; continue with the same command plus resume={run_dir}" if saved else "no checkpoint was saved"
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
