"""The typed config: the schema under every YAML file of conf/ (`schema`, `data_schema`, `mix_schema`, `trainer_schema`,
`sweep_schema`) and the ranges each numeric field declares (`ranges`); freezing a composed config into plain values and
deriving what every rank shares (`frozen`); every key known, to a schema or to the target it is passed to (`known`);
what a run is (`identity`); a rank's view of a frozen config, its strategy
object and the strategy's own checks (`context`); the groups' options (`groups`) and the generated reference
(`reference`). It runs in the parent and in every worker.

May import: `launcher.base`, `launcher.data` (the vocabulary a data option's default reads, and its loader keys),
`strategies`; never the models', checkpoints', worker's or parent's modules. Importing the package costs no torch:
`launch --cfg job` composes without it.

The names most modules want are here: `from launcher.config import ConfigError, freeze, derive, ...`.
"""

from typing import Any

from launcher.base.errors import ConfigError


def __getattr__(name: str) -> Any:
    """The names of `frozen`, imported when first asked for: `launch --help` reads `groups` and pays for no
    OmegaConf."""
    if name in __all__:
        from launcher.config import frozen

        return getattr(frozen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUTO",
    "CPU_DEFAULT_GPUS",
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "GROUPS",
    "SEVERAL",
    "BatchSizeError",
    "ConfigError",
    "Derived",
    "check_world_sizes",
    "derive",
    "freeze",
    "node_range",
    "one_line",
    "target_nodes",
    "valid_micro_sizes",
    "with_schemas",
    "world_sizes",
]
