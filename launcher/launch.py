"""The parent side of a run: validate, freeze the config, start the workers through the elastic agent."""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError, Derived, derive

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(cfg: DictConfig, run_dir: Path) -> tuple[Path, Derived]:
    """Validate the composed config and write `<run_dir>/resolved.yaml`, the only thing workers read."""
    from hydra.utils import instantiate

    from launcher.worker import context

    derived = derive(cfg, visible_cuda_devices())
    resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[assignment]
    resolved["derived"] = derived.as_dict()
    frozen = OmegaConf.create(resolved)
    strategy = instantiate(frozen.strategy)
    try:
        strategy.check(context(frozen, 0, 0, derived.world_size), resolved["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from e
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved.yaml"
    OmegaConf.save(frozen, path)
    return path, derived


def describe(cfg: DictConfig, derived: Derived, run_dir: Path) -> str:
    b = cfg.batch
    return (
        f"launch: {derived.nodes} node(s) x {derived.gpus} {derived.device} worker(s) = world size {derived.world_size}; "
        f"batch: micro {b.micro_size} x accumulation {derived.accumulation} x world {derived.world_size} "
        f"= global {b.global_size}; run dir {run_dir}"
    )


def run_job(cfg: DictConfig) -> int:
    """One run: the task function of the Hydra app (called once per job in a multirun)."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        path, derived = prepare(cfg, run_dir)
    except ConfigError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(describe(cfg, derived, run_dir), flush=True)
    return start_workers(path, derived, cfg.trainer.max_restarts, run_dir)


def _worker_environment(derived: Derived) -> None:
    # One BLAS thread pool per worker would oversubscribe the cores: split them between workers.
    if derived.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // derived.gpus))
    # Restarted workers must not read the dead attempt's addresses from a shared store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def start_workers(resolved: Path, derived: Derived, max_restarts: int, run_dir: Path) -> int:
    """Start `gpus` workers on this node through torch's elastic agent and wait for them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _worker_environment(derived)
    quiet = {rank: Std.ALL for rank in range(1, derived.gpus)}  # rank 0 talks to the terminal
    config = LaunchConfig(
        min_nodes=derived.nodes,
        max_nodes=derived.nodes,
        nproc_per_node=derived.gpus,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=quiet),
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "launcher.worker", str(resolved))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        print(f"launch: error: rank {rank} failed: {_summary(message, failure.exitcode)} (logs: {run_dir / 'logs'})",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def _summary(message: object, exitcode: int) -> str:
    """The line of a worker's error that names the exception, or its exit code (a signal is negative)."""
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if named or lines:
        return (named or lines)[-1]
    return f"exit code {exitcode}" if exitcode >= 0 else f"killed by signal {-exitcode}"
