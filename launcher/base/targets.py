"""What a config's `_target_`s name: imported through Hydra's public lookup, in one place."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def locate(path: str) -> Any:
    """What a `_target_` names, imported (`hydra.utils.get_object`), without the error line Hydra logs on the way: a
    caller that expects a failure says it in its own one line."""
    import logging

    from hydra.utils import get_object

    logger = logging.getLogger("hydra.utils")
    disabled, logger.disabled = logger.disabled, True
    try:
        return get_object(path)
    finally:
        logger.disabled = disabled


def import_targets(node: Any) -> None:
    """Import every `_target_` in a config node (nested ones too: a transformers model's config)."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            locate(str(node._target_))
        for key in node:
            import_targets(node.get(key))
