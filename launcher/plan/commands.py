"""The planner's two entry points: `launch plan` (`main`) and `strategy=auto` (`choose`, called by the launcher).

Both compare strategy presets on the same run: the presets are composed alone, all in one composition (the
rest of the config is the same for every preset), and each is put in place of the run's strategy, where
interpolations such as DeepSpeed's `${optim._target_}` resolve against the run's config, as in the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, read_write

from launcher.config import BatchSizeError, ConfigError, Derived, derive, freeze
from launcher.config.context import check_strategy, make_strategy, with_presets
from launcher.plan.costs import KINDS, UnknownOptimizer
from launcher.plan.fit import make_plan
from launcher.plan.render import as_dict, chart, describe_pick, render, strategy_rows
from launcher.recovery.shm import tier_on
from strategies.base import Strategy

if TYPE_CHECKING:
    from launcher.models.meta import ModelSize

AUTO = "auto"
AUTO_TARGET = "launcher.plan.commands.Auto"


class Auto:
    """The `strategy=auto` marker (conf/strategy/auto.yaml). Not a strategy: nothing can run it.
    launch.prepare() replaces it with the planner's choice (`choose`) before anything else reads the config."""

    def __init__(self, candidates: Sequence[str] = ()) -> None:
        self.candidates = [str(name) for name in candidates]


def is_auto(cfg: DictConfig) -> bool:
    return OmegaConf.select(cfg, "strategy._target_") == AUTO_TARGET


def strategy_names() -> list[str]:
    """Every preset in conf/strategy (the config group is the registry; `--config-dir` adds to it), but auto itself."""
    from hydra.core.global_hydra import GlobalHydra

    options = GlobalHydra.instance().config_loader().get_group_options("strategy")
    return [name for name in options if not name.startswith("base_") and name != AUTO]


def _chosen_strategy(overrides: Sequence[str]) -> tuple[str | None, bool]:
    """The strategy the overrides choose (None: compare every preset), and whether they set strategy.* keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e
    chosen, keys = None, False
    for line, o in zip(overrides, parsed):
        if o.is_sweep_override():
            raise ConfigError(
                f"launch plan takes one value per key, not the sweep {line}; "
                "leave strategy= out to compare every strategy"
            )
        if o.key_or_group == "strategy" and not o.is_delete():
            chosen = o.get_value_element_as_str()
        keys = keys or o.key_or_group.startswith("strategy.")
    return chosen, keys


def _compose(overrides: Sequence[str], config_name: str | None = "config") -> DictConfig:
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e


def _strategies(configs: dict[str, DictConfig]) -> dict[str, Strategy]:
    """Each preset's strategy, for its own rules (`layout`, `collectives`): constructors take plain values and import
    nothing heavy."""
    return {name: make_strategy(c.strategy) for name, c in configs.items()}


def _candidates(frozen: DictConfig) -> dict[str, DictConfig]:
    """strategy=auto's candidates, each in place of auto in the config: strategy.candidates, or every preset that
    trains as one process would (not one that rounds what it sends: `Conformance.lossy`)."""
    presets = strategy_names()
    named = list(frozen.strategy.get("candidates") or [])
    for name in named:
        if name not in presets:
            raise ConfigError(f"strategy.candidates: unknown strategy '{name}'; valid: {', '.join(presets)}")
    configs = with_presets(frozen, named or presets)
    if named:
        return configs
    return {name: c for name, c in configs.items() if not make_strategy(c.strategy).conformance().lossy}


def plan_command(overrides: Sequence[str], measured: Callable[[DictConfig, Any], ModelSize] | None = None) -> int:
    """`launch plan [overrides]`, inside an initialised Hydra (cli.py). Starts nothing, writes no run directory.
    `measured`: the model's sizes with what its optimizer gathers (the launcher's), else the model's alone."""
    from launcher.base.machine import visible_cuda_devices
    from launcher.config.known import check_keys
    from launcher.models.meta import build_on_meta, measure
    from launcher.plan.pipeline import pipeline_lines
    from launcher.plan.tensor import tensor_lines, with_tensor

    chosen, strategy_keys = _chosen_strategy(overrides)
    frozen = freeze(_compose(overrides))
    check_keys(frozen)  # a key its target does not take (+data.seq_lenn=64) would be planned without a word
    # A plan may be for GPUs this machine lacks: count the GPUs asked for as visible.
    devices = max(visible_cuda_devices(), frozen.gpus or 0)
    try:
        derived = derive(frozen, devices)
    except BatchSizeError as e:
        if any(o.lstrip("+").startswith("batch.global_size=") for o in overrides):
            raise  # the user's own size: theirs to fix
        # The default global batch (32) rarely divides over a cluster's ranks: plan one micro-batch per rank.
        with read_write(frozen):
            frozen.batch.global_size = e.per_step
        print(
            f"launch plan: note: planned at batch.global_size={e.per_step} (batch.micro_size x world size, "
            "accumulation 1): the default does not divide over these ranks; set batch.global_size to plan another",
            file=sys.stderr,
        )
        derived = derive(frozen, devices)
    if (pipeline := int(OmegaConf.select(frozen, "strategy.pp_size", default=1) or 1)) > 1:
        print(
            f"launch plan: note: strategy.pp_size={pipeline}: the strategies' table is each one's over the whole "
            "model on every rank; the pipeline section below has each stage's",
            file=sys.stderr,
        )
    model = build_on_meta(frozen.model)
    size = measured(frozen, model) if measured is not None else measure(model)
    if derived.micro_auto:  # batch.micro_size=auto: the run's strategy's own pick; several presets: one sample each
        with read_write(frozen):
            frozen.batch.micro_size = 1
        if chosen is not None and not is_auto(frozen):
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the plan (JSON with plan.format=json)
                frozen, derived = choose_micro(frozen, derived, measure(model), make_strategy(frozen.strategy), None)
        else:
            print(
                "launch plan: note: planned at batch.micro_size=1 (auto picks each strategy's own at launch; name "
                "one, strategy=NAME, to see its pick)",
                file=sys.stderr,
            )
    if chosen is None:  # every preset side by side
        if strategy_keys:
            print(
                "launch plan: note: strategy.* overrides apply with strategy=NAME; comparing the presets as they are",
                file=sys.stderr,
            )
        configs = with_presets(frozen, strategy_names())
    elif is_auto(frozen):  # the candidates auto chooses from
        configs = _candidates(frozen)
    else:
        configs = {chosen: frozen}
    plan = with_tensor(make_plan(frozen, derived, size, _strategies(configs)), model, frozen)
    if frozen.plan.chart:
        chart(plan, str(frozen.plan.chart))
    if frozen.plan.format == "json":
        print(json.dumps(as_dict(plan), indent=2))
    else:
        print(render(plan))
        if tier_on(frozen.trainer):
            print(tier_line(plan, frozen.trainer))
        if lines := tensor_lines(plan, model, frozen):  # T = 1, 2, 4, 8 (none for a model without a plan)
            print("\n".join(lines))
        if lines := pipeline_lines(plan, model, frozen):  # P = 1, 2, 4, 8 (none for a model without a layer list)
            print("\n".join(lines))
        if frozen.plan.chart:
            print(f"chart: {Path(str(frozen.plan.chart)).resolve()}")
    return 0


def choose(
    frozen: DictConfig, derived: Derived, model: Any, size: ModelSize, cuda: int
) -> tuple[str, DictConfig, Derived]:
    """strategy=auto, inside the Hydra app: the name, frozen config and derived values of the strategy with the least
    communication whose per-rank memory fits the device and whose own checks pass. Prints why (one line per
    candidate); raises ConfigError (exit 2) saying what would fit when nothing does. `model` is built on the meta
    device, `size` its sizes (`launcher.models.meta.measure`), `cuda` the GPUs visible (`derive`'s)."""
    from launcher.plan.tensor import with_tensor

    configs = _candidates(frozen)
    plan = with_tensor(make_plan(frozen, derived, size, _strategies(configs)), model, frozen)
    blocked: dict[str, str] = {}
    own = derived
    while (pick := plan.pick(blocked)) is not None:  # the best that fits, unless its own checks refuse it here
        try:
            # The pick's own derived values, not auto's: a tensor-parallel group reads one micro-batch, so its
            # data-parallel ranks and its accumulation are its own (the batch contract: the same global batch).
            own = dataclasses.replace(derive(configs[pick.name], cuda), micro_auto=derived.micro_auto)
            check_strategy(OmegaConf.merge(configs[pick.name], {"derived": own.as_dict()}), model)
            break
        except ConfigError as e:
            blocked[pick.name] = str(e)
    print("\n".join(f"auto: {line}" for line in strategy_rows(plan, blocked, compact=True)), flush=True)
    for name, reason in blocked.items():
        print(f"auto: {name} refused: {reason}", flush=True)
    if pick is None:
        raise ConfigError(f"strategy=auto: {describe_pick(plan, blocked)}")
    print(f"auto: picked {describe_pick(plan, blocked)}", flush=True)
    return pick.name, configs[pick.name], own


def memory_advice(resolved: DictConfig, available: float) -> str:
    """For a run killed for memory: its plan's per-rank figure, the machine's memory, and the presets whose plan
    fits `available` bytes shared by this node's ranks (one line; empty if the plan cannot be made)."""
    from launcher.config import Derived
    from launcher.models.meta import build_on_meta, measure
    from launcher.plan.render import _size

    try:
        names = {f.name for f in dataclasses.fields(Derived)}  # not what the launcher added (model figures, plan peak)
        derived = Derived(**{k: v for k, v in resolved.derived.items() if k in names})
        plain = OmegaConf.create(
            {k: v for k, v in OmegaConf.to_container(resolved).items() if k not in ("derived", "job")}
        )
        per_rank = available / derived.gpus
        plain.plan.device_memory_gb, plain.plan.headroom = per_rank / 1e9, 0.0
        configs = with_presets(plain, strategy_names())
        size = measure(build_on_meta(plain.model))
        plan = make_plan(plain, derived, size, _strategies(configs) | {"this run": make_strategy(plain.strategy)})
    except Exception:  # advice is a courtesy: never hide the failure behind another
        return ""
    mine = next(sp for sp in plan.strategies if sp.name == "this run")
    fitting = [sp.name for sp in plan.ranked() if sp.name != "this run" and plan.fits(sp)]
    return (
        f"the plan's peak per rank is {_size(plan.peak(mine))}; this machine had "
        f"{_size(available)} available for its {derived.gpus} rank(s), {_size(per_rank)} each; "
        f"strategies whose plan fits: {', '.join(fitting) or 'none at this size (launch plan says what would)'}"
    )


def planned_peak(frozen: DictConfig, derived: Derived, size: Any, strategy: Strategy) -> float | None:
    """The plan's peak per rank for the run's own strategy, `strategy` (logged as plan_peak_bytes beside the measured
    peak): on the device, and with device=cpu also what it offloads to host memory (the same memory there). None for
    an optimizer of the user's whose state the planner cannot size: the run goes on, without the planned figure."""
    try:
        plan = make_plan(frozen, derived, size, {"run": strategy})
    except UnknownOptimizer:
        print(f"launch: no plan_peak_bytes: the planner cannot size the state of {frozen.optim._target_}", flush=True)
        return None
    (sp,) = plan.strategies
    return plan.peak(sp)


def job_state(plan: Any, sp: Any) -> int:
    """A checkpoint's bytes for the whole job under a strategy's plan: every kind of model state but the gradients,
    once (DCP writes a tensor that ranks hold alike once, and a sharded one in its shards)."""
    return int(plan.model.params * sum(getattr(sp.bpp, kind) for kind in KINDS if kind != "grads"))


def planned_state(frozen: DictConfig, derived: Derived, size: Any, strategy: Strategy) -> int | None:
    """`job_state` for the run's own strategy; None where the planner cannot size its optimizer."""
    try:
        plan = make_plan(frozen, derived, size, {"run": strategy})
    except UnknownOptimizer:
        return None
    return job_state(plan, plan.strategies[0])


def tier_line(plan: Any, trainer: DictConfig) -> str:
    """What `launch plan` says of the memory tier: the host memory (shared memory) it takes on each node."""
    from launcher.plan.render import _size
    from launcher.recovery.replicas import holds_whole_state
    from launcher.recovery.shm import tier_need

    least, most = plan.derived.min_nodes, plan.derived.nodes
    _, at, count = tier_need(trainer, 10**12, least, most)  # the number of nodes where a shard needs the most room
    each = []
    for sp in plan.strategies:
        whole = holds_whole_state(sp.layout)
        need, _, _ = tier_need(trainer, job_state(plan, sp), least, most, whole)
        each.append(f"{sp.name} {_size(need)}" + (" (the whole state, once, on a failure)" if whole else ""))
    return (
        f"memory tier (trainer.memory_checkpoint_every={trainer.memory_checkpoint_every}): host memory per node, in "
        f"/dev/shm (2 steps x the job's state / {at} node(s) x (1 + {count} replica(s)), where ranks shard it): "
        f"{', '.join(each)}"
    )


def choose_micro(
    frozen: DictConfig,
    derived: Derived,
    size: ModelSize,
    strategy: Strategy,
    adapted: int | None,
    run_dir: Path | None = None,
) -> tuple[DictConfig, Derived]:
    """batch.micro_size=auto: the largest micro-batch that divides the global batch over every world size the job
    may run at and whose planned peak fits the device with plan.headroom there; at most `adapted`, the size an
    out-of-memory error already brought this run down to (`launcher.recovery.adapt`). The frozen config with it, derived
    again; one line says the choice. `size`: the model's sizes (`launcher.models.meta.measure`); `strategy`: the
    run's, made (`launcher.config.context.check_protocol`)."""
    from launcher.config import valid_micro_sizes, world_sizes
    from launcher.plan.render import _size
    from launcher.recovery.adapt import ADAPTED

    worlds = world_sizes(f"{derived.min_nodes}:{derived.nodes}", derived.gpus)
    data = [w // derived.tensor_size for w in worlds]  # a tensor-parallel group reads one micro-batch
    sizes = valid_micro_sizes(int(frozen.batch.global_size), data)
    if adapted is not None and adapted not in sizes:  # `run_dir`'s record (`launcher.recovery.adapt`) is data
        raise ConfigError(
            f"{Path(run_dir or '.') / ADAPTED} holds micro_size {adapted}, which this job never runs at (the sizes "
            f"that divide its global batch over each world size: {', '.join(map(str, sorted(sizes)))}); remove it "
            "to plan the micro-batch afresh"
        )
    valid = [m for m in sizes if adapted is None or m <= adapted]
    with read_write(frozen):
        frozen.batch.micro_size = 1  # planned as one sample; activations scale linearly with the micro-batch
    plan = make_plan(frozen, derived, size, {"run": strategy})
    (run,) = plan.strategies

    def peak(micro: int) -> float:
        return max(plan.need(plan.for_strategy("run", run.strategy, w, micro)) for w in worlds)

    micro = next((m for m in valid if peak(m) <= plan.device.usable), valid[-1])
    with read_write(frozen):
        frozen.batch.micro_size = micro
    accumulation = int(frozen.batch.global_size) // (micro * (derived.world_size // derived.tensor_size))
    chosen = dataclasses.replace(derived, accumulation=accumulation, micro_auto=True)
    larger = [m for m in valid if m > micro]
    fits = "fits" if peak(micro) <= plan.device.usable else "does not fit (none does; the smallest)"
    why = f"; {larger[-1]} would need {_size(peak(larger[-1]))}" if larger else ""
    after = f"; at most {adapted}, where an out-of-memory error brought this run" if adapted is not None else ""
    print(
        f"auto: batch.micro_size={micro} (accumulation {accumulation} at world size {derived.world_size}): the "
        f"largest that divides batch.global_size={frozen.batch.global_size} whose planned peak {_size(peak(micro))} "
        f"{fits} {_size(plan.device.usable)} per rank ({plan.device.source}, plan.headroom={plan.device.headroom:g})"
        f"{why}{after}",
        flush=True,
    )
    return frozen, chosen
