"""The optimizer's checks before start, over the model built on the meta device: optim's rules for param groups, and
the optimizer built over those groups as the workers will build it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.errors import failure
from launcher.config import ConfigError

if TYPE_CHECKING:
    from launcher.models.meta import ModelSize


def check_optimizer(frozen: DictConfig, model: Any) -> str:
    """Refuse in one line a schedule whose phases do not fit, a grouping rule that names no parameter or matches
    none, a group key the optimizer does not take, and values the optimizer refuses; return the start line naming
    each group and its parameters."""
    import inspect

    from hydra.utils import instantiate

    from launcher.optim.build import optimizer_node, rules_for
    from launcher.optim.grouped import TARGET, Grouped
    from launcher.optim.groups import HIDDEN, RULE_KEYS, assign, describe, param_groups, unmatched
    from launcher.optim.schedules import check_schedule

    try:
        check_schedule(frozen.trainer)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    target = frozen.optim._target_
    try:
        optimizer = instantiate(optimizer_node(frozen.optim), _partial_=True, _convert_="all")
        rules = rules_for(frozen.optim, optimizer.func)
    except ValueError as e:
        raise ConfigError(f"optim.groups: {e}") from e
    except Exception as e:
        raise failure("optim", e, f"fix optim._target_={target}: it does not import") from e
    for label in unmatched(model, rules):
        rule = next(r for r in rules if r.rule == label)
        raise ConfigError(
            f"{label} (name={rule.name}, module={rule.module}) matches no trainable parameter (an earlier rule may "
            "take them: the first that matches wins); fix its name pattern or module type, or remove it"
        )
    try:
        takes = set(inspect.signature(optimizer.func).parameters)
    except (TypeError, ValueError):
        takes = None
    hidden = [r for r in rules if r.label == HIDDEN]
    if hidden and not any(p.requires_grad for _, p in assign(model, rules)[rules.index(hidden[0])]):
        raise ConfigError(
            f"optim._target_={target} steps the model's 2-D hidden matrices with Muon, and the model has none (every "
            "trainable parameter is an embedding, the output head, a norm or a bias); use optim=adamw"
        )
    if hidden and (pipeline := int(OmegaConf.select(frozen, "strategy.pp_size", default=1) or 1)) > 1:
        raise ConfigError(
            f"optim._target_={target} (Muon) with strategy.pp_size={pipeline}: Muon does not compose with pipeline "
            "parallel here; use optim=adamw, or strategy.pp_size=1"
        )
    for rule in [r for r in rules if not r.builtin]:
        own, its = _group_optimizer(frozen, rule, target, takes)
        unknown = sorted(k for k in rule.keys if k not in (*RULE_KEYS, TARGET) and its is not None and k not in its)
        if unknown:
            raise ConfigError(
                f"{rule.rule or rule.label}.{unknown[0]}: {own} takes no such key; give a group only keys it takes "
                f"({', '.join(sorted(its - {'params'}))}) or lr_scale"
            )

    def build(node: DictConfig) -> None:
        built = instantiate(optimizer_node(node), _partial_=True, _convert_="all")
        groups = param_groups(model, rules, node.get("lr"))
        if any(g.get(TARGET) for g in groups):  # as the workers build it: one optimizer per group's class
            Grouped(groups, built.func, **built.keywords)
        else:
            built(groups)

    try:
        build(frozen.optim)
    except Exception as e:  # torch's optimizers check their hyperparameters in the constructor
        for key in [str(k) for k in frozen.optim if not str(k).startswith("_")]:
            try:  # the key whose value it refuses: without it (the optimizer's default), it builds
                build(OmegaConf.masked_copy(frozen.optim, [k for k in frozen.optim if k != key]))
            except Exception:
                continue
            value = OmegaConf.to_container(frozen.optim)[key]  # type: ignore[index]
            raise failure("optim", e, f"fix optim.{key}={value}, which {target} refuses") from e
        raise failure("optim", e, f"fix the optim.* values that {target} refuses") from e
    return f"launch: {describe(model, rules)}"


def _group_optimizer(frozen: DictConfig, rule: Any, target: str, takes: set[str] | None) -> tuple[str, set[str] | None]:
    """The optimizer that steps a rule's group, and the keys it takes: the `_target_` the rule names (one line if it
    does not import, or under DeepSpeed, which steps one optimizer of its own), else optim's."""
    import inspect

    from launcher.base.targets import locate

    own = rule.keys.get("_target_")
    if own is None:
        return target, takes
    label = rule.rule or rule.label
    if "deepspeed" in str(frozen.strategy.get("_target_", "")):
        raise ConfigError(
            f"{label}._target_={own}: ZeRO steps one optimizer over its flat partitions, not one per group; use "
            "strategy=ddp, fsdp or hsdp, or remove the group's _target_"
        )
    try:
        optimizer = locate(str(own))
    except Exception as e:
        raise ConfigError(f"{label}._target_={own} does not import ({type(e).__name__}); fix the class path") from e
    try:
        return str(own), set(inspect.signature(optimizer).parameters)
    except (TypeError, ValueError):
        return str(own), None


def measure(frozen: DictConfig, model: Any) -> ModelSize:
    """The model's sizes (`launcher.models.meta.measure`), with the elements its optimizer updates whole: the
    trainable parameters of optim=muon's hidden matrices (the group `rules_for` puts first), none for others."""
    from launcher.base.targets import locate
    from launcher.models.meta import measure as sizes
    from launcher.models.meta import run_plan
    from launcher.optim.build import rules_for
    from launcher.optim.groups import HIDDEN, assign

    size = sizes(model, run_plan(model, frozen))
    try:
        rules = rules_for(frozen.optim, locate(str(frozen.optim._target_)))
    except Exception:  # an optimizer that does not import, a bad rule: `check_optimizer` says which (launch plan: none)
        return size
    hidden = [i for i, r in enumerate(rules) if r.label == HIDDEN]
    taken = assign(model, rules)[hidden[0]] if hidden else []
    return replace(size, gathered=sum(p.numel() for _, p in taken if p.requires_grad))
