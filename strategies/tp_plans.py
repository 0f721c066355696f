"""Tensor-parallel plans: which module is split how, by module-name patterns, read from the config, the model or its
transformers config; and the checks a plan must pass before any worker starts.

A plan maps module names to styles, in transformers' words (`base_model_tp_plan`): "layers.*.self_attn.q_proj":
"colwise". A `*` stands for one part of a module's name (a layer's index). The styles run on torch's own
`parallelize_module` (`strategies.tensor_parallel`); every module the plan does not name keeps its parameters whole,
replicated over the tensor-parallel group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from strategies.declarations import Collective

STYLES = {
    "colwise": "Linear, Embedding",
    "rowwise": "Linear, Embedding",
    "colwise_rep": "Linear, Embedding",
    "colwise_gather_output": "Linear, Embedding",
    "rowwise_rep": "Linear, Embedding",
    "rowwise_split_input": "Linear, Embedding",
    "embedding_rowwise": "Embedding",
    "embedding_colwise": "Embedding",
    "rowwise_sequence": "Linear",
    "sequence_parallel": "",
    "sequence_gather": "",
    "sequence_split": "",
    "replicate": "",
}
"""The styles this launcher runs, by transformers' names, and the module classes each splits ("" any: kept whole).
`colwise` splits a layer's outputs (its weight's rows) and leaves its output split; `rowwise` splits its inputs and
all-reduces its output; `_rep`/`gather_output`: the output gathered whole; `rowwise_rep`/`split_input`: a whole
input, each rank taking its part.

Sequence parallel (Korthikanti et al. 2022; torchtitan's layouts), where the residual stream between layers is split
on the sequence (dim 1) over the group: `sequence_parallel` runs a norm on each rank's part of the sequence (its
weights whole); `sequence_gather` gathers a module's first input whole (an all-gather; its gradient reduce-scattered)
for the colwise layers inside it, or for a whole module; `rowwise_sequence` is rowwise with its output
reduce-scattered over the sequence, not all-reduced; `sequence_split` keeps each rank's part of a whole first input
(the first layer's: no traffic forward). The sequence length must divide by the group's size."""

SEQUENCE = ("sequence_parallel", "sequence_gather", "sequence_split", "rowwise_sequence")
"""The styles that split the sequence: a plan with any of them needs a sequence length the group's size divides."""


def weight_dim(style: str, module: nn.Module) -> int | None:
    """The dimension of `module`'s weight that `style` splits; None: kept whole."""
    if style == "replicate" or style.startswith("sequence_"):
        return None
    if style in ("embedding_rowwise", "embedding_colwise"):
        return 0 if style == "embedding_rowwise" else 1
    rowwise = style.startswith("rowwise")
    if isinstance(module, nn.Embedding):  # torch's rowwise splits an embedding's vocabulary, colwise its width
        return 0 if rowwise else 1
    return 1 if rowwise else 0


def fits(style: str, module: nn.Module) -> bool:
    """Whether `style` splits a module of `module`'s class (`STYLES`)."""
    kinds = STYLES[style]
    return not kinds or isinstance(module, tuple(getattr(nn, k.strip()) for k in kinds.split(",")))


def split_tensors(model: nn.Module, resolved: Mapping[str, str]) -> set[int]:
    """The ids of the parameters a resolved plan splits over the group: the weights of the modules it names, and the
    biases of the colwise ones (a rowwise layer's bias is added once, whole). Every other parameter (norms, a rowwise
    layer's bias, what the plan does not name) each rank of the group keeps whole."""
    modules, split = dict(model.named_modules()), set()
    for name, style in resolved.items():
        dim = weight_dim(style, modules[name])
        for pname, p in modules[name].named_parameters(recurse=False):
            if dim is not None and (pname == "weight" or dim == 0):
                split.add(id(p))
    return split


def split_params(model: nn.Module, resolved: Mapping[str, str]) -> int:
    """The parameters a resolved plan splits over the group (`split_tensors`), each counted once."""
    split = split_tensors(model, resolved)
    return sum(p.numel() for p in model.parameters() if id(p) in split)


def model_plan(model: nn.Module) -> dict[str, str]:
    """The plan a model declares: its own `_tp_plan` (the built-in GPT's; a transformers model's, whose instance
    holds its whole plan, base model prefixed), else its transformers config's `base_model_tp_plan` under its base
    model's prefix; {} where it declares none."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return {str(k): str(v) for k, v in own.items()}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and prefix in dict(model.named_children())
    return {(f"{prefix}.{k}" if inner else str(k)): str(v) for k, v in base.items()}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in name.split(".")))


def resolve(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Each module of `model` a pattern of `plan` names, by its full name, with its style (the first pattern wins)."""
    patterns = [(_pattern(k), v) for k, v in plan.items()]
    found = {}
    for name, _ in model.named_modules():
        style = next((v for p, v in patterns if name and p.fullmatch(name)), None)
        if style is not None:
            found[name] = style
    return found


def chosen_plan(model: nn.Module, explicit: Mapping[str, str] | None) -> tuple[dict[str, str], str]:
    """The plan a run uses (`strategy.tp_plan`, else the model's) and where it comes from, for the lines below."""
    if explicit:
        return {str(k): str(v) for k, v in explicit.items()}, "strategy.tp_plan"
    return model_plan(model), f"{type(model).__name__}'s own plan"


def heads(model: nn.Module) -> dict[str, int]:
    """The head counts tensor parallel splits: a transformers config's attention and key/value heads, or the
    `n_head` of the model's attention modules (the built-in GPT's)."""
    config = getattr(model, "config", None)
    found = {}
    if config is not None and hasattr(config, "get_text_config"):
        text = config.get_text_config()
        for key in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(text, key, None), int):
                found[f"{key}"] = int(getattr(text, key))
    for module in model.modules():
        if isinstance(getattr(module, "n_head", None), int):
            found.setdefault("model.n_head", int(module.n_head))
    return found


def check_plan(model: nn.Module, explicit: Mapping[str, str] | None, tp_size: int) -> dict[str, str]:
    """The resolved plan, or ValueError (one line: the bad value and the fix): no plan, a plan that names no module,
    a style not run here or on a module it cannot split, heads that do not divide, tied weights split two ways."""
    plan, where = chosen_plan(model, explicit)
    example = 'strategy.tp_plan=\'{"layers.*.mlp.fc1": colwise, "layers.*.mlp.fc2": rowwise}\''
    if not plan:
        raise ValueError(
            f"strategy.tp_size={tp_size}: {type(model).__name__} declares no tensor-parallel plan (no _tp_plan, no "
            f"config.base_model_tp_plan); give one by module names, e.g. {example}, or use strategy=fsdp"
        )
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"{where}: style '{style}' of '{pattern}' is not one this launcher runs ({', '.join(STYLES)}); "
                "name one of those, or leave the module out (kept whole)"
            )
    resolved = resolve(model, plan)
    if not any(style != "replicate" for style in resolved.values()):
        some = list(
            dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n, m in model.named_modules() if isinstance(m, nn.Linear))
        )[:3]
        raise ValueError(
            f"{where} names no module of {type(model).__name__} to split (patterns {', '.join(plan)}); name its "
            f"modules by their full names, with * for a layer's index (e.g. {', '.join(some) or 'blocks.*.fc'})"
        )
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        kinds = STYLES[style]
        if not fits(style, modules[name]):
            raise ValueError(
                f"{where}: {name} is a {type(modules[name]).__name__}, but style '{style}' splits only {kinds}; "
                f"name its Linear layers instead, or use 'replicate'"
            )
    attention = any(("attn" in n or "attention" in n) and v != "replicate" for n, v in resolved.items())
    for key, count in heads(model).items() if attention else ():  # a plan of MLPs alone splits no heads
        if count % tp_size:
            raise ValueError(
                f"strategy.tp_size={tp_size} does not divide {key}={count}: each rank must hold whole heads; use a "
                f"tp_size that divides {count}"
            )
    _check_ties(model, resolved)
    return resolved


def _check_ties(model: nn.Module, resolved: Mapping[str, str]) -> None:
    """One parameter reachable from two modules (tied embeddings) must be split the same way by both."""
    owners: dict[int, list[tuple[str, int | None]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            style = resolved.get(name, "replicate")
            dim = weight_dim(style, module) if pname == "weight" or style == "replicate" else None
            owners.setdefault(id(p), []).append((f"{name}.{pname}", dim))
    for uses in owners.values():
        if len({dim for _, dim in uses}) > 1:
            told = ", ".join(f"{n} ({'whole' if d is None else f'split on dim {d}'})" for n, d in uses)
            raise ValueError(
                f"tensor parallel splits a tied weight two ways: {told}; give both modules styles that split it alike "
                "(e.g. embedding_rowwise and colwise_rep), or leave both out"
            )


def tp_collectives(
    model: nn.Module, plan: Mapping[str, str], tokens: int, accumulation: int, dtype: str
) -> list[Collective]:
    """The activations' collectives of one optimizer step under a plan, over `tokens` (micro-batch x sequence) per
    micro-step, in the compute dtype; what the `tp_comm_*` figures count. Per micro-step: each rowwise layer
    all-reduces its output in the forward (`rowwise_sequence`: reduce-scatters it, and all-gathers its gradient);
    each colwise layer all-reduces its input's gradient in the backward (its input is whole on every rank, its
    gradient a part on each), unless its input is a `sequence_gather`'s (the parts' sum is then reduce-scattered
    once, by the gather) and, where its output is gathered (`_rep`), all-gathers it in the forward; a rowwise
    embedding all-reduces its output, a colwise one all-gathers it; a `sequence_gather` all-gathers its input, a
    `sequence_split` its input's gradient. Per step: a `sequence_parallel` norm's weights' gradients (partial sums
    over each rank's part of the sequence) all-reduced, once for the micro-steps' sum."""
    found = []
    modules = dict(model.named_modules())
    resolved = resolve(model, plan)
    gathered = [name for name, style in resolved.items() if style == "sequence_gather"]

    def per_micro(kind: str, elements: int) -> None:
        found.append(Collective(kind, "tensor", tokens * elements, dtype, times=accumulation, sync=False))

    for name, style in resolved.items():
        module, dim = modules[name], weight_dim(style, modules[name])
        inside = [n for n in gathered if name.startswith(n + ".")]
        if style == "sequence_parallel":
            for p in module.parameters(recurse=False):
                found.append(Collective("all_reduce", "tensor", p.numel(), dtype, times=1, sync=True))
        elif style == "sequence_split":
            per_micro("all_gather", _width(module))
        elif style == "sequence_gather":
            per_micro("all_gather", _width(module))
            colwise = any(n.startswith(name + ".") and v.startswith("colwise") for n, v in resolved.items())
            if colwise:  # their partial gradients, summed and reduce-scattered (else its gradient comes whole)
                per_micro("reduce_scatter", _width(module))
        if dim is None:
            continue
        embedding = isinstance(module, nn.Embedding)
        width_in = module.embedding_dim if embedding else module.in_features
        width_out = module.embedding_dim if embedding else module.out_features
        if embedding:
            per_micro("all_reduce" if dim == 0 else "all_gather", width_out)
        elif style == "rowwise_sequence":
            per_micro("reduce_scatter", width_out)
            per_micro("all_gather", width_out)
        elif dim == 1:  # rowwise: partial sums of its output
            per_micro("all_reduce", width_out)
        else:
            if not inside:
                per_micro("all_reduce", width_in)
            if style in ("colwise_rep", "colwise_gather_output"):
                per_micro("all_gather", width_out)
    return found


def _width(module: nn.Module) -> int:
    """The width of the activations entering `module`: its first Linear's inputs, norm's or embedding's width."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.Embedding):
            return m.embedding_dim
        shape = getattr(m, "normalized_shape", None)
        if shape:
            return int(shape[-1])
        weight = getattr(m, "weight", None)  # a norm of a class of its own (RMSNorm): a weight of its width
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return int(weight.shape[0])
    raise ValueError(f"{type(module).__name__}: no Linear, Embedding or norm to tell the width of its activations")
