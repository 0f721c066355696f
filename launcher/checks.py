"""The parent's checks of a frozen config, before any worker starts: each failure is a ConfigError (one line).

They take the model already built on the meta device (`launcher.meta`), so nothing here builds it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.config import ConfigError, sweep_identity
from launcher.context import make_strategy, run_context


def check_strategy(frozen: DictConfig, model: Any) -> None:
    """The strategy's own checks, from rank 0's view of a frozen config that carries `derived`."""
    strategy = make_strategy(frozen.strategy)
    try:
        strategy.check(run_context(frozen, 0, 0, frozen.derived.world_size), model)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_resume(frozen: DictConfig, run_dir: Path, model: Any) -> Path | None:
    """The checkpoint `resume=` names, checked against the model's shapes; None when there is none."""
    from launcher.checkpoint import CheckpointError, check_fits, find_resume

    try:
        identity = {"config_hash": frozen.job.config_hash, "sweep_dir": frozen.job.get("sweep_dir")}
        if identity["sweep_dir"]:  # a sweep's job: the same job of an earlier sweep, by its overrides
            identity["overrides"] = sweep_identity(frozen.job.overrides)
        found = find_resume(frozen.resume, run_dir, identity)
        if found is not None:
            check_fits(found, model)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e
    if frozen.resume == "auto":
        print(f"launch: resume=auto: {f'resuming from {found}' if found else 'no earlier checkpoint, starting fresh'}")
    return found
