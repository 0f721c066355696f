"""Every key of the launcher's own schema is one it knows. Hydra's `+` adds a key to a typed config without a word:
`+trainer.checkpoint_evry=100` would run to the end and save nothing. A key that no schema field and no target takes
is refused before start, naming the nearest known key.

Each node's schema is read from the composed config itself (its dataclass), so a field is known where it is
declared, with no list of keys kept here. Open, as before:
- a node with a `_target_` (a group's option, data's collate, a pruner) takes what its target takes: `check_keys`
  holds a group's targets to their signatures once the config is frozen (a model or optimizer of your own,
  `+model.KEY=VALUE`), and a built-in one that takes `**keys` (a data source, a logger) to its schema's fields;
- a node typed `dict` or `Any` (a DeepSpeed config, the loggers by name): its keys are its own;
- Hydra's node (`hydra.*`), which is Hydra's to check.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher.base.errors import ConfigError
from launcher.config.optim_schema import RECIPE_KEYS

OPEN_AT_THE_TOP = ("hydra",)
"""Top-level keys that are not the launcher's: Hydra's own node, composed beside the run's config."""


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """(dotted path, node) of every config node under `node`, itself first, without resolving any value."""
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        yield path, node
        children = [(f"{path}.{key}" if path else str(key), node._get_node(key)) for key in node]
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        children = [(f"{path}[{i}]", node._get_node(i)) for i in range(len(node))]
    else:
        return
    for name, child in children:
        if not (path == "" and name in OPEN_AT_THE_TOP):
            yield from _nodes(child, name)


def _fields(node: DictConfig) -> list[str] | None:
    """The keys a node's schema declares; None where the node is open (no dataclass, or a target's)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema) or "_target_" in node:
        return None
    return [f.name for f in dataclasses.fields(schema)]


def unknown_key(cfg: DictConfig) -> str | None:
    """One line for the first key of a composed config (its schema still attached) that no schema field and no
    target takes, naming the nearest known key; None when every key is known."""
    known = [
        f"{path}.{name}" if path else name
        for path, node in _nodes(cfg)
        if (fields := _fields(node)) is not None
        for name in fields
    ]
    for path, node in _nodes(cfg):
        fields = _fields(node)
        for key in [str(k) for k in node] if fields is not None else []:
            if key in fields or (path == "" and key in OPEN_AT_THE_TOP):
                continue
            name = f"{path}.{key}" if path else key
            value = node._get_node(key)
            given = f"{name}={value}" if not isinstance(value, DictConfig | ListConfig) else name
            fix = _nearest(name, path, fields, known)
            return f"unknown key {given}: no schema or target of the launcher takes it; {fix}"
    return None


def _nearest(name: str, path: str, siblings: list[str], known: list[str]) -> str:
    """The fix: the closest key of the same node, else a key of that name or nearly elsewhere (set at the wrong
    level), else the node's keys."""
    leaf = name.rpartition(".")[2]
    close = difflib.get_close_matches(leaf, siblings, n=1)
    if close:
        return f"did you mean {path + '.' if path else ''}{close[0]}?"
    by_leaf = {k.rpartition(".")[2]: k for k in reversed(known)}  # the outermost key of each name
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)  # closer: a section's key named alone
    if close:
        return f"did you mean {by_leaf.get(close[0], close[0])}?"
    where = path or "the top level"
    return f"{where} has: {', '.join(sorted(siblings))}"


# What the launcher itself passes to each group's target, besides the keys in its config node.
PASSED_BY_THE_LAUNCHER = {
    "strategy": (),
    "model": (),
    "data": ("split", "role", "workers", "collate", "val"),  # the loader's keys (LOADER_KEYS), never passed on
    "optim": ("params", *RECIPE_KEYS),  # the launcher's own: groups, no_decay, muon_lr ...
    "logger": ("run_config", "run_dir"),
}


def check_keys(frozen: DictConfig) -> None:
    """Every key of a target's config node (nested targets too) must be a parameter it takes: a model of your own
    under the built-in GPT's keys is a one-line error naming the keys and the fix, not a TypeError in a worker.
    ConfigError (one line) otherwise."""
    from launcher.config import target_nodes

    for group, passed in PASSED_BY_THE_LAUNCHER.items():
        for path, node in target_nodes(frozen, group):
            _check_node_keys(node, path, group, passed)


def _check_node_keys(node: Any, path: str, group: str, passed: tuple[str, ...] = ()) -> None:
    import inspect

    from launcher.base.targets import locate

    if not isinstance(node, DictConfig) or node.get("_target_") is None:  # no target (data.collate unset)
        return
    target = str(node._target_)
    given = [str(k) for k in node if not str(k).startswith("_")]
    for key in given:
        _check_node_keys(node.get(key), f"{path}.{key}", group)
    try:
        parameters = inspect.signature(locate(target)).parameters.values()
    except (ImportError, TypeError, ValueError):  # not importable (derive says so) or no signature to read
        return
    names = {
        p.name for p in parameters if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        schema = _schema_of(target, group)  # a built-in target reads its keys from its node: its schema's fields
        if schema is None:
            return  # a target of your own that takes any key
        names |= {f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")}
    unknown = sorted(k for k in given if k not in names and k not in passed)
    if unknown:
        raise ConfigError(_not_taken(path, group, target, unknown, sorted(names - set(passed))))


def _schema_of(target: str, group: str) -> type | None:
    """The schema of the built-in option whose `_target_` is `target`, as the group's stored schemas hold it (a
    built-in data source or logger takes `**keys` and reads them as its schema names them:
    `launcher.base.settings`), or None."""
    from hydra.core.config_store import ConfigStore

    for entry in ConfigStore.instance().repo.get(group, {}).values():
        node = getattr(entry, "node", None)
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if dataclasses.is_dataclass(schema) and node.get("_target_") == target:
            return schema  # type: ignore[return-value]
    return None


ELSEWHERE = {
    f"strategy.{key}": "tensor parallel runs under FSDP2 alone (DDP and DeepSpeed keep every layer whole): use "
    "strategy=fsdp_tp, or strategy.tp_size=T on strategy=fsdp or hsdp"
    for key in ("tp_size", "tp_plan", "tp_across_nodes", "loss_parallel")
} | {
    f"strategy.{key}": "pipeline parallel runs under FSDP2 alone: use strategy.pp_size=P on strategy=fsdp or hsdp"
    for key in ("pp_size", "pp_schedule", "pp_stages_per_rank", "pp_split", "pp_balance", "pp_across_nodes")
}
"""Keys of one strategy's that another does not take, with where they belong."""


def _not_taken(path: str, group: str, target: str, unknown: list[str], takes: list[str]) -> str:
    """The nearest key the target takes where one key is close to it (misspelt), else how to pass keys of your own
    (several: a built-in option's keys under a target of yours)."""
    keys = ", ".join(f"{path}.{k}" for k in unknown)
    close = difflib.get_close_matches(unknown[0], takes, n=1) if len(unknown) == 1 else []
    if f"{path}.{unknown[0]}" in ELSEWHERE:
        fix = ELSEWHERE[f"{path}.{unknown[0]}"]
    elif close:
        fix = f"did you mean {path}.{close[0]}?"
    elif path == group and group in ("model", "data"):
        fix = f"use {group}=custom {group}._target_={target}, then add its own keys with +{group}.KEY=VALUE"
    else:
        fix = f"remove them (~{path}.{unknown[0]}) or name a target that takes them"
    return f"{path}._target_={target} does not take {keys} (it takes: {', '.join(takes) or 'nothing else'}); {fix}"
