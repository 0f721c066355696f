"""The typed schema of the optim group (`optim=adamw|sgd|muon|custom`), which `launcher.config.schema` stores with the
others, and the keys every optim node has for its param groups (`launcher.optim.groups`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from launcher.config.ranges import COUNT, FRACTION, POSITIVE, SIZE, UNIT, ranged

RECIPE_KEYS = ("groups", "no_decay")
"""Keys of every optim node that the launcher reads itself (its param groups), never passed to the optimizer."""


@dataclass
class ParamGroupsConfig:
    """The param groups every optim choice takes (`launcher.optim.groups`)."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    """Rules for param groups, the first that matches a parameter wins: each a name pattern (`name`, a glob over
    the full parameter name) and/or a module type (`module`, a class name), with `lr_scale` (times optim.lr),
    `weight_decay` or any other key the optimizer takes. A rule that matches no trainable parameter is refused."""
    no_decay: bool = True
    """After optim.groups' rules: no weight decay on biases, normalisation weights (by module type) and embeddings;
    false: every parameter that no rule takes gets optim.weight_decay (the rule before 0.3)."""


@dataclass
class AdamWConfig(ParamGroupsConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = ranged(1e-3, COUNT)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = ranged(1e-8, POSITIVE)
    weight_decay: float = ranged(0.1, COUNT)


@dataclass
class SGDConfig(ParamGroupsConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = ranged(0.1, COUNT)
    momentum: float = ranged(0.9, UNIT)
    weight_decay: float = ranged(0.0, COUNT)


class NSDtype(Enum):
    fp32 = "fp32"
    bf16 = "bf16"


@dataclass
class MuonConfig(ParamGroupsConfig):
    """optim=muon: Muon over the 2-D hidden matrices, AdamW over the rest (embeddings, the output head, norms,
    biases), each at its own rate; under ddp, fsdp and hsdp (each matrix's update computed whole)."""

    _target_: str = "launcher.optim.muon.MuonAdamW"
    lr: float = ranged(3e-4, COUNT)
    """AdamW's peak rate (the schedule's)."""
    muon_lr: float = ranged(0.02, COUNT)
    """Muon's peak rate, scaled by the same schedule (torch.optim.Muon's shape adjustment on top)."""
    momentum: float = ranged(0.95, FRACTION)
    nesterov: bool = True
    ns_steps: int = ranged(5, SIZE)
    """Newton-Schulz iterations per update."""
    ns_dtype: NSDtype = NSDtype.fp32
    """The Newton-Schulz iteration's arithmetic: fp32 (the same update at any world size and layout, to fp32's
    rounding); bf16, torch.optim.Muon's own (faster on GPUs; on the suite's job its losses leave fp32's by the figure
    docs/configuration.md gives)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = ranged(1e-8, POSITIVE)
    weight_decay: float = ranged(0.1, COUNT)
    """Decoupled weight decay of both (the no_decay group's none, as with AdamW)."""


@dataclass
class CustomOptimConfig(ParamGroupsConfig):
    """optim=custom: any optimizer class, optim._target_=torch.optim.Adagrad or one of your own, called with the
    parameters, lr and the keys you add with +optim.KEY=VALUE. lr is the schedule's peak."""

    _target_: str = MISSING
    lr: float = ranged(1e-3, COUNT)
