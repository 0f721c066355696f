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


# What the launcher itself passes to each group's target, besides the keys in its config node.
PASSED_BY_THE_LAUNCHER = {
    "strategy": (),
    "model": (),
    "data": ("split",),
    "optim": ("params",),
    "logger": ("run_config", "run_dir"),
}


def check_keys(frozen: DictConfig) -> None:
    """Every key of a target's config node (nested targets too) must be a parameter it takes: a model of your own
    under the built-in GPT's keys is a one-line error naming the keys and the fix, not a TypeError in a worker."""
    for group, passed in PASSED_BY_THE_LAUNCHER.items():
        _check_node_keys(frozen[group], group, group, passed)


def _check_node_keys(node: Any, path: str, group: str, passed: tuple[str, ...] = ()) -> None:
    import inspect

    from hydra._internal.utils import _locate

    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    target = str(node._target_)
    given = [str(k) for k in node if not str(k).startswith("_")]
    for key in given:
        _check_node_keys(node.get(key), f"{path}.{key}", group)
    try:
        parameters = inspect.signature(_locate(target)).parameters.values()
    except (ImportError, TypeError, ValueError):  # not importable (derive says so) or no signature to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    unknown = sorted(k for k in given if k not in names and k not in passed)
    if not unknown:
        return
    takes = ", ".join(sorted(names - set(passed))) or "nothing else"
    keys = ", ".join(f"{path}.{k}" for k in unknown)
    if path == group and group in ("model", "data"):
        fix = f"use {group}=custom {group}._target_={target}, then add its own keys with +{group}.KEY=VALUE"
    else:
        fix = f"remove them (~{path}.{unknown[0]}) or name a target that takes them"
    raise ConfigError(f"{path}._target_={target} does not take {keys} (it takes: {takes}); {fix}")
