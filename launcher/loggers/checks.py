"""The loggers' checks before start (the parent calls them): the packages a logger needs, its folders, wandb's
mode and reach."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (a logger's check: its package is heavy)."""
    from importlib.util import find_spec

    try:
        return find_spec(package) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module left without a spec
        return False


def can_make(folder: Path) -> bool:
    """Whether this user can make `folder` or write in it: its nearest existing parent is a folder it can write."""
    path = folder.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def check_loggers(frozen: Any) -> None:
    """Before any worker starts, in the launcher: each logger's own `check` of its settings, where it has one (the
    built-in ones do: their package installed, their values, their server or folder reachable), without starting a
    run. ConfigError (one line)."""
    from omegaconf import OmegaConf

    from launcher.base.errors import ConfigError, failure
    from launcher.base.targets import locate
    from launcher.config import target_nodes

    for path, node in target_nodes(frozen, "logger"):
        check = getattr(locate(str(node._target_)), "check", None)
        if not callable(check):
            continue
        settings = {k: v for k, v in OmegaConf.to_container(node).items() if not str(k).startswith("_")}
        try:
            check(**settings)
        except (ConnectionError, ImportError) as e:  # its package, its service: the message says what to do
            raise ConfigError(str(e)) from e
        except (TypeError, ValueError) as e:
            raise failure("logger", e, f"fix the {path}.* values") from e
