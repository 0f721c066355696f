"""A rank's view of a frozen config: its `RunContext` and its strategy object.

Workers build them for themselves; the launcher builds rank 0's for the strategy's checks before any worker
starts, and the planner builds strategies to read their layouts. One function each, so all three see the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from strategies import RunContext, Strategy


def run_context(cfg: DictConfig, rank: int, local_rank: int, world_size: int, micro: int | None = None) -> RunContext:
    """What a strategy may know of the run, for one rank of a frozen config that carries `derived`: at `world_size`
    and `micro` (an elastic job's size now, the micro-batch an out-of-memory error left: `launcher.adapt`), with
    the accumulation that keeps the global batch."""
    derived = cfg.derived
    micro = micro or int(cfg.batch.micro_size)
    accumulation, rest = divmod(int(cfg.batch.global_size), micro * world_size)
    if rest or not accumulation:
        raise ValueError(f"batch.global_size={cfg.batch.global_size} does not divide over micro-batch {micro} x world "
                         f"size {world_size}")  # fmt: skip
    return RunContext(
        device=f"cuda:{local_rank}" if derived.device == "cuda" else "cpu",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        precision=str(cfg.precision),
        grad_clip=float(cfg.trainer.grad_clip),
        accumulation=accumulation,
        micro_size=micro,
        compile=bool(cfg.trainer.compile),
        local_world_size=int(derived.gpus),
        no_grad=tuple(str(name) for name in derived.get("no_grad") or ()),
    )


def make_strategy(strategy: DictConfig) -> Strategy:
    """The strategy a config node names, built from plain values (dicts and lists, no OmegaConf nodes)."""
    from hydra.utils import instantiate

    return instantiate(strategy, _convert_="all")


def with_presets(frozen: DictConfig, names: Sequence[str]) -> dict[str, DictConfig]:
    """The frozen run config with each preset conf/strategy/<name>.yaml as its strategy, by name (each frozen).
    Inside a compose context (the app's, or a caller's)."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from launcher.config import ConfigError, freeze

    # One composition of the strategy group alone, each preset at a key of its own: a fifth of the time of
    # composing the whole config once per preset (`launch plan` has 3 s).
    try:
        presets = compose(None, overrides=[f"+strategy@{name}={name}" for name in names])
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e
    configs = {}
    for name in names:
        cfg = OmegaConf.create(OmegaConf.to_container(frozen))
        cfg.strategy = presets[name]
        configs[name] = freeze(cfg)
    return configs


def preset_strategies(names: list[str], **options: Any) -> dict[str, Strategy]:
    """Each preset of conf/strategy/ built as a run of the default config builds it, for what it declares of itself
    (`layout`, `collectives`, `requirements`, `conformance`); `options` over each preset's keys. A strategy's
    defaults are its schema's, written there alone: this is how to build one outside a run (after
    `launcher.schema.register()`, which the launcher's own entry points have made)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from launcher.config import freeze

    def build() -> dict[str, Strategy]:
        configs = with_presets(freeze(compose("config")), names)
        return {name: make_strategy(OmegaConf.merge(cfg.strategy, options)) for name, cfg in configs.items()}

    if GlobalHydra.instance().is_initialized():  # inside the app, or a caller's compose context
        return build()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return build()


def preset_strategy(name: str, **options: Any) -> Strategy:
    """conf/strategy/<name>.yaml's strategy, `options` over its keys (see `preset_strategies`)."""
    return preset_strategies([name], **options)[name]


def preset_dataset(name: str, split: str, **options: Any) -> Any:
    """conf/data/<name>.yaml's dataset of `split`, `options` over its keys, built as a run builds it: a data
    function's defaults are its schema's, written there alone (after `launcher.schema.register()`)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from launcher.data import build_dataset

    def build() -> Any:
        node = compose("config", overrides=[f"data={name}"]).data
        plain = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
        return build_dataset(OmegaConf.merge(plain, options), split)

    if GlobalHydra.instance().is_initialized():
        return build()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return build()
