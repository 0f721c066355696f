"""Parameter groups by rule: which parameters take weight decay, and at what learning rate, decided from each
parameter's name and the types of the modules that hold it, so that every strategy builds the same groups.

The rules, in order, the first that matches wins:
1. `optim.groups`, the user's rules: a name pattern (`name`, a shell-style glob over the full parameter name) and/or
   a module type (`module`, the name of a class the holding module is an instance of), with `lr_scale`,
   `weight_decay` or any other key the optimizer takes; with `optim.no_decay` and no `weight_decay` of its own, the
   biases, norms and embeddings a rule takes form a group of their own beside it (`optim.groups[0].no_decay`);
2. with `optim.no_decay` (the default), biases, normalisation weights and embeddings: weight decay 0;
3. everything else, with optim's own values.

Normalisation layers are found by type: torch's LayerNorm, RMSNorm, GroupNorm, BatchNorm and InstanceNorm, and any
class whose name (or a base class's) ends in `Norm` (transformers' `LlamaRMSNorm`, `T5LayerNorm`, ...), which holds
its gain as a plain parameter. Embeddings: `nn.Embedding`, `nn.EmbeddingBag`, and the parameters a module named
`...Embedding(s)` holds itself (a ViT's position embeddings and class token).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from launcher.config.optim_schema import RECIPE_KEYS  # noqa: F401  (re-exported for the worker)
from strategies.stepping import LR_SCALE

RULE_KEYS = ("name", "module", "lr_scale")
"""A rule's own keys; every other key of a rule is the optimizer's, for its group."""
GROUP = "group"
"""The param-group key naming the rule that made it (recorded in checkpoints with the group)."""

HIDDEN = "hidden_matrices"
"""The built-in group of an optimizer for hidden matrices (optim=muon), and the kind of parameter it takes."""
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
_NORM_NAME = re.compile(r"Norm(?:[123]d)?$")
_EMBEDDING_NAME = re.compile(r"Embeddings?$")


@dataclass(frozen=True)
class Rule:
    """One way of grouping parameters: which it takes, and the group's own optimizer keys."""

    label: str
    """How the start line and the checkpoint name the group: optim.groups[0], no_decay, decay."""
    name: str | None = None
    module: str | None = None
    keys: dict[str, Any] = field(default_factory=dict)
    """lr_scale, weight_decay and the optimizer's other keys for this group."""
    builtin: bool = False
    exempt: bool = False
    """Only the parameters the default leaves out of weight decay (a user's rule's no_decay part)."""
    rule: str = ""
    """The user's rule this is (a part of), or empty for the built-in ones."""

    def matches(self, names: list[str], owners: list[nn.Module], kind: str | None) -> bool:
        if self.builtin:
            return self.label == "decay" or (kind == HIDDEN) == (self.label == HIDDEN) and kind is not None
        kind = None if kind == HIDDEN else kind
        if self.exempt and kind is None:
            return False
        by_name = self.name is None or any(fnmatch.fnmatchcase(n, self.name) for n in names)
        by_type = self.module is None or any(self.module in _class_names(m) for m in owners)
        return by_name and by_type


def rules_of(optim: Any) -> list[Rule]:
    """The rules of a config's optim node (plain values or a DictConfig), the built-in ones after the user's.

    Raises ValueError (one line) for a rule with neither a name nor a module, or with a bad lr_scale."""
    rules = []
    for i, given in enumerate(optim.get("groups") or []):
        given = dict(given)
        label = f"optim.groups[{i}]"
        if given.get("name") is None and given.get("module") is None:
            raise ValueError(f"{label}={given} names no parameters; give it a name pattern and/or a module type")
        scale = given.get(LR_SCALE, 1.0)
        if not isinstance(scale, (int, float)) or scale < 0:
            raise ValueError(f"{label}.lr_scale={scale} is not a number >= 0; give a factor of optim.lr")
        keys = {k: v for k, v in given.items() if k not in ("name", "module")}
        name, module = given.get("name"), given.get("module")
        if optim.get("no_decay", True) and "weight_decay" not in keys:  # its biases, norms, embeddings: still none
            exempt = {**keys, "weight_decay": 0.0}
            rules.append(Rule(f"{label}.no_decay", name, module, exempt, exempt=True, rule=label))
        rules.append(Rule(label, name, module, keys, rule=label))
    if optim.get("no_decay", True):
        rules.append(Rule("no_decay", keys={"weight_decay": 0.0}, builtin=True))
    rules.append(Rule("decay", builtin=True))
    return rules


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__} | {
        f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__
    }


def kind_of(leaf: str, owners: list[nn.Module]) -> str | None:
    """Why the default leaves a parameter out of weight decay (bias, norm, embedding), or None."""
    if any(isinstance(m, _NORM_TYPES) or any(_NORM_NAME.search(c.__name__) for c in type(m).__mro__) for m in owners):
        return "norm"
    if any(
        isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        or any(_EMBEDDING_NAME.search(c.__name__) for c in type(m).__mro__)
        for m in owners
    ):
        return "embedding"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "bias"
    return None


def named_owners(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, list[str], list[nn.Module]]]:
    """Each parameter once (its first name, as in checkpoints), with all its names and the modules that hold it (a
    tied parameter has several)."""
    names: dict[int, list[str]] = {}
    owners: dict[int, list[nn.Module]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for leaf, p in m.named_parameters(recurse=False):
            if p is None:
                continue
            names.setdefault(id(p), []).append(f"{path}.{leaf}" if path else leaf)
            if not any(o is m for o in owners.setdefault(id(p), [])):
                owners[id(p)].append(m)
    for name, p in module.named_parameters():
        yield name, p, names.get(id(p), [name]), owners.get(id(p), [])


def hidden_rule(keys: dict[str, Any]) -> Rule:
    """The built-in rule of an optimizer for hidden matrices (optim=muon): every 2-D parameter that is no embedding,
    norm or bias, and not the output head (`_head`)."""
    return Rule(HIDDEN, keys=keys, builtin=True)


def _head(module: nn.Module) -> int | None:
    """The id of the output head's weight: a transformers model's output embeddings, or else the last `nn.Linear`
    with a row per token of the first embedding's vocabulary."""
    getter = getattr(module, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        vocab = next((m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)), None)
        linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
        head = linears[-1] if linears else None
    return id(head.weight) if head is not None and isinstance(getattr(head, "weight", None), nn.Parameter) else None


def assign(module: nn.Module, rules: list[Rule]) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters each rule takes (the first that matches wins), in the module's order: frozen ones too, so that
    a rule that matches only frozen parameters is still seen to match."""
    taken: list[list[tuple[str, nn.Parameter]]] = [[] for _ in rules]
    head = _head(module)
    for name, p, names, owners in named_owners(module):
        kind = kind_of(name.rpartition(".")[2], owners)
        if kind is None and p.dim() == 2 and id(p) != head:
            kind = HIDDEN
        index = next(i for i, r in enumerate(rules) if r.matches(names, owners, kind))
        taken[index].append((name, p))
    return taken


def param_groups(module: nn.Module, rules: list[Rule], lr: float | None) -> list[dict[str, Any]]:
    """torch's param groups of the trainable parameters, one per rule that takes some, named (`group`), with the
    rule's keys and its learning rate (`lr` x lr_scale, where the optimizer takes an lr)."""
    groups = []
    for rule, members in zip(rules, assign(module, rules), strict=True):
        params = [p for _, p in members if p.requires_grad]
        if not params:
            continue
        group: dict[str, Any] = {"params": params, GROUP: rule.label, **rule.keys}
        if lr is not None:
            group["lr"] = lr * float(rule.keys.get(LR_SCALE, 1.0))
        groups.append(group)
    return groups


def unmatched(module: nn.Module, rules: list[Rule]) -> list[str]:
    """The user's rules that take no trainable parameter (a later rule may take all it would have: first wins)."""
    taken: dict[str, bool] = {}
    for rule, members in zip(rules, assign(module, rules), strict=True):
        if rule.rule:
            taken[rule.rule] = taken.get(rule.rule, False) or any(p.requires_grad for _, p in members)
    return [label for label, some in taken.items() if not some]


def describe(module: nn.Module, rules: list[Rule]) -> str:
    """The start line's clause: each group and its parameter count, `decay 1,234,567 / no_decay 12,345 (...)`."""
    parts = []
    for rule, members in zip(rules, assign(module, rules), strict=True):
        count = sum(p.numel() for _, p in members if p.requires_grad)
        if count:
            keys = ", ".join(f"{k} {round(v, 6) if isinstance(v, float) else v}" for k, v in rule.keys.items())
            parts.append(f"{rule.label} {count:,}" + (f" ({keys})" if keys else ""))
    return "optimizer param groups: " + "; ".join(parts) + " parameters"
