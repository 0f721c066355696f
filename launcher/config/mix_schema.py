"""The typed schema of data=mix (conf/data/mix.yaml), and each source's own schema filled in: a source written as
`data.sources.NAME: {weight: W, _target_: launcher.data.store.Store, url: ...}` takes the defaults, types and keys of
the built-in option with that `_target_`, as if it were the run's data (`with_source_schemas`, called once when the
config is frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config.data_schema import CollateConfig
from launcher.config.ranges import COUNT, ranged


class MixEnd(Enum):
    stop = "stop"
    """A source that ends ends the run on every rank at the same step (as a single stream does)."""
    drop = "drop"
    """A source that ends leaves the mixture; the others' weights are renormalised."""


@dataclass
class MixDataConfig:
    """data=mix: a weighted mixture of sources, each any data config (launcher/mixture/mix.py)."""

    _target_: str = "launcher.mixture.mix.Mix"
    _recursive_: bool = False
    """The sources are built by the mixture, one split at a time, not by Hydra."""
    sources: Any = None
    """NAME: {weight: W, _target_: ..., its keys; epochs: N (a map-style source ends after N epochs)}."""
    schedule: Any = None
    """Weights by step, piecewise linear: [{step: S, weights: {NAME: W, ...}}, ...] in increasing steps; before the
    first point the weights go from the sources' own (at step 0); after the last they stay."""
    on_end: MixEnd = MixEnd.stop
    """A source that ends (a stream, or data.sources.NAME.epochs): stop ends the run; drop leaves it out."""
    workers: int = ranged(0, COUNT, identity=False)
    """1: one DataLoader process reads the mixture ahead of the loop (0: in the loop); the same order either way."""
    collate: CollateConfig = field(default_factory=lambda: CollateConfig())
    """The collate of a rank's micro-batch, which holds samples of several sources (launcher/data/collate.py)."""


def with_source_schemas(cfg: DictConfig) -> DictConfig:
    """data=mix: each source merged over the schema of the built-in data option with its `_target_` (a target of
    your own is left as it is), the interpolations of that schema's defaults made the source's own (`${data.url}` ->
    `${data.sources.NAME.url}`). ConfigError (one line) for a key or value that schema refuses."""
    from hydra.core.config_store import ConfigStore
    from omegaconf.errors import OmegaConfBaseException

    from launcher.base.errors import ConfigError
    from launcher.mixture.weights import SOURCE_KEYS

    sources = OmegaConf.select(cfg, "data.sources", default=None)
    if OmegaConf.select(cfg, "data._target_", default=None) != MixDataConfig._target_ or not sources:
        return cfg
    stored = [e.node for e in ConfigStore.instance().repo.get("data", {}).values() if getattr(e, "node", None)]
    cfg = cfg.copy()
    for name in list(sources):
        node = sources[name]
        if not isinstance(node, DictConfig):
            continue
        target = node.get("_target_")
        schema = next((s for s in stored if OmegaConf.get_type(s) is not dict and s.get("_target_") == target), None)
        if schema is None:
            continue
        own = OmegaConf.masked_copy(node, [k for k in node if k not in SOURCE_KEYS])
        mixing = {k: node[k] for k in node if k in SOURCE_KEYS}
        prefix = f"${{data.sources.{name}."
        defaults = {
            k: v.replace("${data.", prefix)
            for k, v in OmegaConf.to_container(schema).items()
            if isinstance(v, str) and "${data." in v and k not in own
        }
        try:
            merged = OmegaConf.merge(schema, defaults, own)
        except OmegaConfBaseException as e:
            key = f"data.sources.{name}.{e.key}" if getattr(e, "key", None) else f"data.sources.{name}"
            raise ConfigError(
                f"{key}: {str(e).strip().splitlines()[0]} (the schema of {target}, which that source names: "
                f"{', '.join(k for k in schema if k != '_target_')})"
            ) from e
        whole = OmegaConf.merge(OmegaConf.create(OmegaConf.to_container(merged)), mixing)
        OmegaConf.update(cfg, f"data.sources.{name}", whole, merge=False)
    return cfg
