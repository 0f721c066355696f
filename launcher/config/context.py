"""A rank's view of a frozen config: its `RunContext`, its strategy object, and the strategy's own checks.

Workers build them for themselves; the launcher builds rank 0's for the strategy's checks before any worker
starts, and the planner builds strategies to read their layouts. One function each, so all three see the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.errors import ConfigError
from strategies import RunContext, Strategy
from strategies.declarations import Requirements
from strategies.ema import EMASettings


def run_context(cfg: DictConfig, rank: int, local_rank: int, world_size: int, micro: int | None = None) -> RunContext:
    """What a strategy may know of the run, for one rank of a frozen config that carries `derived`: at `world_size`
    and `micro` (an elastic job's size now, the micro-batch an out-of-memory error left:
    `launcher.recovery.adapt`), with the accumulation that keeps the global batch."""
    derived = cfg.derived
    micro, tensor = micro or int(cfg.batch.micro_size), int(derived.get("tensor_size", 1))
    accumulation, rest = divmod(int(cfg.batch.global_size), micro * (world_size // tensor))
    if rest or not accumulation:
        raise ValueError(
            f"batch.global_size={cfg.batch.global_size} does not divide over micro-batch {micro} x "
            f"data-parallel ranks {world_size // tensor}"
        )
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
        ema=ema_settings(cfg.trainer),
        tensor_size=tensor,
        seq_len=seq_len if isinstance(seq_len := cfg.data.get("seq_len"), int) else None,
        pipeline_size=int(OmegaConf.select(cfg, "strategy.pp_size", default=1) or 1),
    )


def ema_settings(trainer: DictConfig) -> EMASettings | None:
    """trainer.ema as the strategy's plain values; None where trainer.ema.decay is unset."""
    ema = trainer.get("ema") or {}
    if ema.get("decay") is None:
        return None
    return EMASettings(float(ema.decay), int(ema.get("every", 1)), int(ema.get("start", 0)))


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

    from launcher.config.frozen import ConfigError, freeze

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
    `launcher.config.schema.register()`, which the launcher's own entry points have made)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from launcher.config.frozen import freeze

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
    function's defaults are its schema's, written there alone (after `launcher.config.schema.register()`)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from launcher.data.builtin import build_dataset

    def build() -> Any:
        node = compose("config", overrides=[f"data={name}"]).data
        plain = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
        return build_dataset(OmegaConf.merge(plain, options), split)

    if GlobalHydra.instance().is_initialized():
        return build()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return build()


PROTOCOL = tuple(name for name, value in vars(Strategy).items() if callable(value) and not name.startswith("_"))
"""The methods of `strategies.base.Strategy`."""


def check_protocol(frozen: DictConfig) -> Strategy:
    """The strategy implements the whole protocol (not one of the user's written to an older one), before anything
    reads it: the planner, its own checks. Returns it, made once for the planner."""
    strategy = make_strategy(frozen.strategy)
    missing = [name for name in PROTOCOL if not callable(getattr(strategy, name, None))]
    if missing:
        raise ConfigError(
            f"strategy {frozen.strategy._target_} lacks {', '.join(f'{m}()' for m in missing)} of the Strategy "
            "protocol (strategies/base.py): add them, e.g. collectives() returning the collectives of one step"
        )
    return strategy


def check_strategy(frozen: DictConfig, model: Any) -> Requirements:
    """The strategy's own checks, from rank 0's view of a frozen config that carries `derived`; what it requires.
    Where parameters got no gradient from the first micro-batch (`derived.no_grad`), one line names them, with what
    the strategy says it does about them."""
    from strategies.no_grad import no_grad_line

    strategy = make_strategy(frozen.strategy)
    ctx = run_context(frozen, 0, 0, frozen.derived.world_size)
    try:
        clause = strategy.check(ctx, model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if frozen.derived.get("no_grad"):
        said = clause if isinstance(clause, str) else None
        print(no_grad_line(list(frozen.derived.no_grad), model, said), flush=True)
    return strategy.requirements()
