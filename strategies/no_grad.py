"""Parameters that get no gradient: named, and kept to one rule under every strategy.

The rule is torch's for a parameter whose `.grad` is None: a step in which a parameter gets no gradient does not
change it, neither by weight decay nor by the optimizer's moments. The launcher finds the parameters that get none on
a first micro-batch (a backward on the meta device) and hands their names to the strategy (`RunContext.no_grad`):

- DDP leaves them out of its buckets (which would wait for them forever) and all-reduces them itself once per step,
  with a flag each: a parameter gets the average gradient in a step where some rank's forward used it, and none where
  no rank's did (`AbsentGradients`), as `find_unused_parameters=true` gives every parameter, without its search of
  the autograd graph at every forward.
- FSDP2 reduce-scatters only the gradients that exist: where no rank's forward used a parameter, it has none.
- DeepSpeed's ZeRO reduces every parameter through flat buffers, so one that got none has a zero gradient: put in a
  param group without weight decay (`without_decay`), a parameter that never gets a gradient keeps zero moments and
  does not move. One that gets a gradient in some steps and none in others moves in the others too (its moments are no
  longer zero), and misses the weight decay of the steps where it is used: said in one line at start.

Parameters of a mixture-of-experts block are not among them: every strategy gives each of them a gradient at every
step, zero where no token went to it (`strategies.moe`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from strategies.comm import CommCounter

SHOWN = 6
"""Groups of names a line shows; the rest are counted."""


def grouped(names: Sequence[str], model: nn.Module | None = None) -> str:
    """Parameter names in a line, by module: `vision_tower.post_layernorm.{weight,bias}`; with the model, a module all
    of whose trainable parameters (in more than one module) are named is one group, `pooler.*`."""
    named = set(names)
    whole: list[str] = []
    for path, module in model.named_modules() if model is not None else ():
        if not path or any(path.startswith(w + ".") for w in whole):
            continue
        mine = [f"{path}.{n}" for n, p in module.named_parameters() if p.requires_grad]
        if len({n.rpartition(".")[0] for n in mine}) > 1 and all(n in named for n in mine):
            whole.append(path)
    groups: dict[str, list[str]] = {}
    for name in names:
        outer = next((w for w in whole if name.startswith(w + ".")), None)
        if outer is not None:
            groups.setdefault(f"{outer}.*", [])
            continue
        holder, _, leaf = name.rpartition(".")
        groups.setdefault(holder, []).append(leaf)
    parts = [
        key
        if not leaves
        else (f"{key}." if key else "") + (leaves[0] if len(leaves) == 1 else f"{{{','.join(leaves)}}}")
        for key, leaves in groups.items()
    ]
    rest = len(parts) - SHOWN
    return ", ".join(parts[:SHOWN]) + (f" and {rest} more module(s)" if rest > 0 else "")


def count(names: Sequence[str]) -> str:
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''}"


# ------------------------------------------------------------------ DDP


UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def no_grad_line(names: Sequence[str], model: nn.Module, clause: str | None) -> str:
    """The launcher's line naming the parameters that got no gradient from the first micro-batch, with what the
    strategy says it does about them (`clause`)."""
    line = f"launch: {count(names)} got no gradient from the first micro-batch: {grouped(names, model)}"
    return f"{line}; {clause}" if clause else line


def ddp_unused(message: str, module: nn.Module, ignored: Sequence[str]) -> tuple[int, list[str]] | None:
    """The rank and the names of the parameters DDP's "Expected to have finished reduction" error lists by index (its
    reducer's order: the module's trainable parameters less those it was told to ignore); None if it lists none."""
    found = UNUSED_INDICES.search(message)
    if found is None:
        return None
    order = [n for n, p in module.named_parameters() if p.requires_grad and n not in set(ignored)]
    indices = [int(i) for i in found.group(2).split()]
    return int(found.group(1)), [order[i] for i in indices if i < len(order)]


class AbsentGradients:
    """DDP's parameters that got no gradient on the launcher's first micro-batch, left out of its buckets, synchronised
    here once per optimizer step: one all-reduce of their gradients (zero where a rank has none) and a flag each, then
    the average where any rank had a gradient, and None where no rank had one."""

    def __init__(self, module: nn.Module, names: Sequence[str], counter: CommCounter) -> None:
        own = dict(module.named_parameters())
        self.names = [n for n in names if n in own and own[n].requires_grad]
        self.params = [own[n] for n in self.names]
        self.counter = counter

    def broadcast(self) -> None:
        """Rank 0's values (DDP broadcasts only the parameters in its buckets when it wraps the model)."""
        import torch.distributed as dist

        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=0)

    def reduce(self, world_size: int) -> None:
        import torch.distributed as dist

        if not self.params:
            return
        device = self.params[0].device
        flags = torch.tensor([float(p.grad is not None) for p in self.params], device=device)
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params]
        flat = torch.cat([*grads, flags])
        self.counter.record(flat, "all_reduce")
        dist.all_reduce(flat)
        offset = 0
        for p, used in zip(self.params, flat[-len(self.params) :].tolist()):
            chunk = flat[offset : offset + p.numel()]
            offset += p.numel()
            p.grad = (chunk / world_size).view_as(p).to(p.dtype) if used > 0 else None


# ------------------------------------------------------------------ DeepSpeed


def without_decay(optimizer: torch.optim.Optimizer, module: nn.Module, names: Sequence[str]) -> None:
    """Move the parameters `names` names out of each param group that decays them, into a group of their own beside it
    with weight decay 0 (a parameter with a zero gradient and zero moments then stays as it is), marked with the index
    of the group it came from; none is moved out of a group it would leave empty. Before the optimizer's first step."""
    named = {id(p) for n, p in module.named_parameters() if n in set(names)}
    for index, group in enumerate(list(optimizer.param_groups)):
        moved = [p for p in group["params"] if id(p) in named]
        if not moved or len(moved) == len(group["params"]) or not group.get("weight_decay"):
            continue
        group["params"] = [p for p in group["params"] if id(p) not in named]
        hyper = {k: v for k, v in group.items() if k != "params"}
        optimizer.add_param_group({**hyper, "params": moved, "weight_decay": 0.0, NO_GRAD_GROUP: index})


NO_GRAD_GROUP = "launch_no_gradient"
"""Marks a param group `without_decay` adds, with the index of the group its parameters came from: a checkpoint lists
them in that group, as the optimizer of every other strategy holds them."""
