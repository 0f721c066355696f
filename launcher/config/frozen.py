"""Freeze a composed config, validate it and derive the values every rank shares, once, in the parent.

`freeze` turns the composed config into plain values once (interpolations resolved, enums as their
names): every later reader (the checks, the planner, the workers through `resolved.yaml`) sees strings,
never Enum members. Everything here is plain Python over an OmegaConf node: no torch import, so that
config-only commands stay fast. The caller passes what it detected about the machine (visible GPUs).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.errors import ConfigError
from launcher.config.mix_schema import with_source_schemas

CPU_DEFAULT_GPUS = 2
"""Workers per node on CPU when `gpus` is unset: enough to exercise real collectives."""
EXIT_FAILED = 1
"""A run that started and failed (a rank raised or died, the rendezvous timed out)."""
EXIT_BAD_INPUT = 2
"""Input refused before any worker started: one line on stderr, nothing written."""


def one_line(e: BaseException) -> str:
    """Hydra's or OmegaConf's multi-line report (and its causes) as one line: its first three distinct lines."""
    parts: list[str] = []
    seen: BaseException | None = e
    while seen is not None:
        for line in (line.strip() for line in str(seen).splitlines()):
            if line and not line.startswith(("object_type", "reference_type")) and line not in parts:
                parts.append(line)
        seen = seen.__cause__
    return "; ".join(parts[:3]) or "invalid configuration"


def freeze(cfg: DictConfig) -> DictConfig:
    """The composed config as plain values: interpolations resolved, enums as their names, no schema attached.

    The one place where enums become strings, where a key no schema or target takes is refused (`known`), and where
    every numeric field is checked against the range its schema declares (`schema.check_ranges`), while the schema
    is still attached; `resolved.yaml` is this config
    plus what the launcher derived.
    """
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    from launcher.config.known import unknown_key
    from launcher.config.ranges import check_ranges

    cfg = with_source_schemas(with_schemas(cfg))  # data=mix: each source over its own option's schema
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
    except InterpolationResolutionError as e:  # e.g. model.block_size=${data.seq_len} under a data without seq_len
        ours = _resolver_error(e)
        if ours is not None:  # a resolver of the launcher's refused the value it resolves from: its line says why
            raise ours from e
        raise ConfigError(f"{e.full_key}: {str(e).strip().splitlines()[0]}; set {e.full_key}=... yourself") from e
    if missing:
        raise ConfigError(f"{missing[0]} has no value; set it on the command line: {missing[0]}=...")
    problem = unknown_key(cfg) or check_ranges(cfg)
    if problem:
        raise ConfigError(problem)
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException as e:
        raise _resolver_error(e) or ConfigError(str(e).strip().splitlines()[0]) from e
    return OmegaConf.create(plain)  # type: ignore[arg-type]


def _resolver_error(e: BaseException) -> ConfigError | None:
    """Under OmegaConf's error, the ConfigError a resolver raised (`${launch_vocab:...}`: a tokenizer that does not
    load), or a missing value it was given (data.tokenizer unset), named as such."""
    from omegaconf.errors import MissingMandatoryValue

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        if isinstance(seen, MissingMandatoryValue) and str(seen).startswith("Missing mandatory value: "):
            key = str(seen).splitlines()[0].removeprefix("Missing mandatory value: ").strip()
            return ConfigError(f"{key} has no value; set it on the command line: {key}=...")
        seen = seen.__cause__ or seen.__context__
    return None


GROUPS = ("strategy", "model", "data", "optim", "logger")
SEVERAL = ("logger",)
"""Groups whose options are chosen several at once (`logger=[wandb,mlflow]`), each under its own name."""


def target_nodes(cfg: DictConfig, group: str) -> list[tuple[str, Any]]:
    """(dotted path, node) of each target a group holds: the group's node, or one per option of a group chosen several
    at once (`logger.wandb`, `logger.mlflow`; none for `logger=none`)."""
    node = OmegaConf.select(cfg, group)
    if group not in SEVERAL:
        return [(group, node)]
    if not isinstance(node, DictConfig):
        return []
    if "_target_" in node:  # an option file written for one logger at a time, without its name
        raise ConfigError(
            f"{group} has a _target_ of its own: each {group} option goes under its name, several at once; start your "
            f"option's file with '# @package {group}.<its name>' (as conf/{group}/mlflow.yaml does)"
        )
    return [(f"{group}.{name}", node[name]) for name in node]


def with_schemas(cfg: DictConfig) -> DictConfig:
    """A group's option written without its schema (your own preset: `_target_: strategies.ddp.DDP` and a key or two)
    takes the schema of the built-in option with the same `_target_`, as if it had named it in its defaults: its
    defaults (written there alone), types, ranges and keys. ConfigError (one line) for a key or value that schema
    refuses."""
    from hydra.core.config_store import ConfigStore
    from omegaconf.errors import OmegaConfBaseException

    stored = ConfigStore.instance().repo
    for group in GROUPS:
        for path, node in target_nodes(cfg, group):
            if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is not dict:
                continue  # composed over its schema already (or no option at all)
            target = node.get("_target_")
            schemas = [e.node for e in stored.get(group, {}).values() if getattr(e, "node", None) is not None]
            for schema in schemas:
                if OmegaConf.get_type(schema) is not dict and schema.get("_target_") == target:
                    try:
                        merged = OmegaConf.merge(schema, node)
                    except OmegaConfBaseException as e:
                        key = f"{path}.{e.key}" if getattr(e, "key", None) else path
                        raise ConfigError(
                            f"{key}: {str(e).strip().splitlines()[0]} (the schema of {target}, which your {group} "
                            f"option names: {', '.join(k for k in schema if k != '_target_')})"
                        ) from e
                    cfg = cfg.copy()
                    OmegaConf.update(cfg, path, merged, merge=False)
                    break
    return cfg


@dataclass(frozen=True)
class Derived:
    device: str
    """cpu or cuda."""
    gpus: int
    """Worker processes per node."""
    nodes: int
    world_size: int
    accumulation: int
    """Micro-steps per optimizer step: global / (micro x world size)."""
    min_nodes: int = 1
    """The fewest nodes an elastic job (nodes=MIN:MAX) goes on with; `nodes` is the most, and what is planned for.
    Equal to `nodes` for a job of a fixed size."""
    micro_auto: bool = False
    """batch.micro_size=auto: the planner chose the micro-batch, and an out-of-memory error halves it
    (`launcher.recovery.adapt`)."""
    tensor_size: int = 1
    """strategy.tp_size x strategy.pp_size: ranks that see the same micro-batches (a tensor-parallel group's
    consecutive ranks, in each stage of a pipeline: `RunContext.data_rank`); accumulation is global / (micro x world
    size / tensor_size)."""

    def forks_workers(self, trainer: Any) -> bool:
        """CPU workers are forked from the launcher, which has torch and the run's modules imported already
        (`trainer.fork_workers`); CUDA ones start afresh: a CUDA driver touched there (`device=auto` asks it) is
        unusable in a forked child."""
        return self.device == "cpu" and bool(trainer.fork_workers)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nearest_multiples(value: int, unit: int) -> str:
    below = (value // unit) * unit
    above = below + unit
    return f"{below} or {above}" if below > 0 else f"{above}"


AUTO = "auto"
"""batch.micro_size=auto: the planner picks it (`launcher.plan.commands.choose_micro`, `launcher.recovery.adapt`)."""


class BatchSizeError(ConfigError):
    """A global batch that does not divide over micro-batches and ranks: `per_step` (micro x world) is the unit."""

    def __init__(self, per_step: int, message: str) -> None:
        super().__init__(message)
        self.per_step = per_step


def derive(cfg: DictConfig, cuda_devices: int) -> Derived:
    """Check a frozen config (`freeze`) against the rules of a run and return the derived values.

    Raises ConfigError with a one-line message naming the bad value and the fix.
    """
    batch = cfg.batch
    device = str(cfg.device)
    if device == "auto":
        device = "cuda" if cuda_devices > 0 else "cpu"
    if device == "cuda" and cuda_devices == 0:
        chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
        if chosen is not None:  # the usual cause: GPUs hidden from this process
            raise ConfigError(
                f"device=cuda but no CUDA device is visible with CUDA_VISIBLE_DEVICES={chosen!r}; name the GPUs in "
                "CUDA_VISIBLE_DEVICES or unset it, or use device=cpu"
            )
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if device == "cuda":
        gpus = cfg.gpus if cfg.gpus is not None else cuda_devices
        if gpus > cuda_devices:
            raise ConfigError(
                f"gpus={gpus} but only {cuda_devices} CUDA device(s) are visible on this node; "
                f"use gpus={cuda_devices} or fewer"
            )
    else:
        gpus = cfg.gpus if cfg.gpus is not None else CPU_DEFAULT_GPUS

    low, high = node_range(cfg.nodes)
    world_size = gpus * high
    auto = batch.micro_size == AUTO
    micro = 1 if auto else int(batch.micro_size)  # auto: planned later (`plan.commands.choose_micro`)
    tensor = int(OmegaConf.select(cfg, "strategy.tp_size", default=1) or 1)  # a tensor-parallel group: one batch
    if world_size % tensor:
        raise ConfigError(
            f"strategy.tp_size={tensor} does not divide the world size {world_size} (nodes x gpus); use one of "
            f"{', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)}"
        )
    pipeline = int(OmegaConf.select(cfg, "strategy.pp_size", default=1) or 1)  # a pipeline's ranks: one batch too
    if (world_size // tensor) % pipeline:
        rest = world_size // tensor
        raise ConfigError(
            f"strategy.pp_size={pipeline} does not divide the world size {world_size} (nodes x gpus)"
            f"{f' / strategy.tp_size={tensor}' if tensor > 1 else ''}; use one of "
            f"{', '.join(str(d) for d in range(1, rest + 1) if rest % d == 0)}"
        )
    if pipeline > 1 and OmegaConf.select(cfg, "data._target_", default=None) == "launcher.mixture.mix.Mix":
        raise ConfigError(
            f"data=mix with strategy.pp_size={pipeline}: a mixture's losses per source do not compose "
            "with pipeline parallel here; use strategy.pp_size=1"
        )
    if pipeline > 1 and (low < high or int(OmegaConf.select(cfg, "trainer.memory_checkpoint_every", default=0) or 0)):
        what = f"nodes={cfg.nodes} (elastic)" if low < high else "trainer.memory_checkpoint_every (the memory tier)"
        raise ConfigError(
            f"{what} with strategy.pp_size={pipeline}: it does not compose with pipeline parallel here; "
            "use a fixed nodes=N and trainer.memory_checkpoint_every=0, or strategy.pp_size=1"
        )
    tensor *= pipeline
    per_step = micro * world_size // tensor
    check_world_sizes(batch.global_size, batch.micro_size, cfg.nodes, gpus)  # an elastic range: every size in it
    if batch.global_size % per_step:
        given = "" if auto else f" batch.micro_size={micro} x"
        raise BatchSizeError(
            per_step,
            f"batch.global_size={batch.global_size} is not divisible by{given} "
            f"{'world size' if tensor == 1 else 'data-parallel ranks'} {world_size // tensor} "
            f"(= {per_step}); use batch.global_size="
            f"{_nearest_multiples(batch.global_size, per_step)}, or change batch.micro_size or gpus",
        )
    if low < high and not cfg.trainer.max_restarts:
        raise ConfigError(
            f"nodes={cfg.nodes} lets nodes leave and join, but trainer.max_restarts=0 ends the job when the first one "
            "leaves; set trainer.max_restarts=3 (each node that leaves costs one restart; one that joins, none)"
        )
    _check_data(cfg)
    _check_trainer(cfg.trainer)
    _check_targets(cfg)
    return Derived(device, gpus, high, world_size, batch.global_size // per_step, low, auto, tensor)


def node_range(nodes: Any) -> tuple[int, int]:
    """`nodes` as (fewest, most): N is (N, N); MIN:MAX an elastic range. ConfigError (one line) for an empty range."""
    if isinstance(nodes, int):
        return nodes, nodes
    match = re.fullmatch(r"(\d+):(\d+)", str(nodes))
    if not match:
        raise ConfigError(f"nodes={nodes} is neither a number of nodes nor MIN:MAX; e.g. nodes=2 or nodes=1:4")
    low, high = int(match[1]), int(match[2])
    if not 1 <= low <= high:
        raise ConfigError(f"nodes={nodes} is not a range MIN:MAX with 1 <= MIN <= MAX; e.g. nodes={max(1, high)}:{low}")
    return low, high


def world_sizes(nodes: Any, gpus: int) -> list[int]:
    low, high = node_range(nodes)
    return [n * gpus for n in range(low, high + 1)]


def valid_micro_sizes(global_size: int, worlds: list[int]) -> list[int]:
    """Every micro-batch that divides the global batch at each world size of `worlds`, largest first."""
    return [m for m in range(global_size, 0, -1) if all(global_size % (m * w) == 0 for w in worlds)]


def check_world_sizes(global_size: int, micro: Any, nodes: Any, gpus: int) -> None:
    """An elastic job's global batch must divide over micro-batches and ranks at every world size it may run at:
    ConfigError naming a micro-batch that works for all of them (or a global batch, where none does)."""
    worlds = world_sizes(nodes, gpus)
    if len(worlds) == 1:
        return
    valid = valid_micro_sizes(global_size, worlds)
    if micro == AUTO:
        if valid:
            return
        bad = [w for w in worlds if global_size % w]  # not even at micro-batch 1
    else:
        bad = [w for w in worlds if global_size % (int(micro) * w)]
        if not bad:
            return
    import math

    lcm = math.lcm(*worlds)
    fix = (
        f"batch.micro_size={next(m for m in valid if micro == AUTO or m <= int(micro))} works at all of them"
        if valid
        else f"batch.global_size={_nearest_multiples(global_size, lcm * (1 if micro == AUTO else int(micro)))} divides "
        "over all of them"
    )
    shown = f"batch.micro_size={micro}" if micro != AUTO else "any micro-batch"
    raise ConfigError(
        f"nodes={nodes} may run at world sizes {', '.join(map(str, worlds))}, but batch.global_size={global_size} "
        f"does not divide over {shown} x world size {bad[0]}; {fix}"
    )


def _check_data(cfg: DictConfig) -> None:
    """data=tokens reads a file at data.path (data=hf's path is what load_dataset takes, checked as it loads)."""
    path = OmegaConf.select(cfg.data, "path", default=None)
    tokens = OmegaConf.select(cfg.data, "_target_", default=None) == "launcher.data.builtin.Tokens"
    if tokens and path is not None and not Path(os.path.expanduser(str(path))).is_file():
        raise ConfigError(f"data.path={path} does not exist or is not a file; point data.path at a token file")


def _check_trainer(trainer: DictConfig) -> None:
    steps = trainer.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1] <= trainer.max_steps):
        raise ConfigError(
            f"trainer.profile_steps={list(steps)} is not [first, last] with 1 <= first <= last <= trainer.max_steps="
            f"{trainer.max_steps}; e.g. trainer.profile_steps=[{min(3, trainer.max_steps)},{min(4, trainer.max_steps)}]"
        )
    at = trainer.memory_snapshot_step
    if at is not None and (not trainer.memory_snapshot or at > trainer.max_steps):
        raise ConfigError(
            f"trainer.memory_snapshot_step={at} needs trainer.memory_snapshot=true and a step <= trainer.max_steps="
            f"{trainer.max_steps}; set both, e.g. trainer.memory_snapshot=true trainer.memory_snapshot_step="
            f"{min(at, trainer.max_steps)}"
        )


def _check_targets(cfg: DictConfig) -> None:
    """Every `_target_` must import here, in the launcher, rather than in every worker."""
    from launcher.base.targets import locate

    for group in GROUPS:
        for path, _ in target_nodes(cfg, group):
            target = OmegaConf.select(cfg, f"{path}._target_", default=None)
            if target is None:
                raise ConfigError(
                    f"{path} has no _target_; name the class or function to build it with {path}._target_=..."
                )
            try:
                locate(str(target))
            except ImportError as e:
                lines = [line.strip() for line in str(e).splitlines() if line.strip()]
                reason = lines[-1] if lines else type(e).__name__
                raise ConfigError(
                    f"{path}._target_={target} cannot be imported ({reason}); fix the path or install its package"
                ) from e
