"""Mixture-of-experts blocks: a router sends each token to a few experts, so in a step a rank may not run an expert
another rank runs. Its parameters then get no gradient on that rank, and every strategy that reduces only the
gradients it has (FSDP2's reduce-scatter of a unit, DeepSpeed's buckets) or gathers parameters module by module
(ZeRO-3) issues collectives of other sizes than the other ranks': gloo aborts, NCCL hangs or sums wrong numbers.

What every strategy does about it: each block's forward runs with every one of its parameters in the graph, each
times zero. The block's output is unchanged (x + 0 is x), every parameter gets a gradient (zero where the rank did
not use it), so every rank reduces the same tensors, and every strategy and world size steps the same parameters:
an expert no token of the global batch went to gets a zero gradient (the optimizer steps it as any parameter with
a zero gradient: AdamW's moments decay and its weight decay applies), not none. FSDP keeps the block inside one unit;
ZeRO-3 gathers the whole block at once (a leaf module, `deepspeed.utils.set_z3_leaf_modules`), so no rank gathers an
expert the others skip.

A block is found by its structure: a module with a child named `experts` (transformers' MoE models — Mixtral, Qwen2-,
Qwen3-MoE, OLMoE, DeepSeek — and most hand-written ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

EXPERTS = "experts"


def moe_blocks(model: nn.Module, explicit: list[str] | None = None) -> list[nn.Module]:
    """The model's mixture-of-experts blocks, outermost only: modules of the `explicit` class names when given, else
    the modules with a child named `experts`."""
    if explicit is not None:
        found = [m for m in model.modules() if type(m).__name__ in explicit]
    else:
        found = [m for m in model.modules() if isinstance(getattr(m, EXPERTS, None), nn.Module)]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def check_moe_blocks(model: nn.Module, explicit: list[str] | None) -> None:
    """ValueError (one line) when `strategy.moe_blocks` names a class the model does not have."""
    if explicit and not moe_blocks(model, explicit):
        present = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ValueError(
            f"strategy.moe_blocks: no module of class {', '.join(explicit)} in {type(model).__name__} "
            f"(its classes: {', '.join(present)})"
        )


def block_classes(blocks: list[nn.Module]) -> list[str]:
    return sorted({type(m).__name__ for m in blocks})


def units_inside(model: nn.Module, blocks: list[nn.Module], unit_names: list[str]) -> list[str]:
    """Unit classes (FSDP's shard units) of which some module lies strictly inside an MoE block: a unit that ranks
    may skip."""
    inside = {type(sub).__name__ for block in blocks for sub in block.modules() if sub is not block}
    return sorted(set(unit_names) & inside)


def use_every_parameter(blocks: list[nn.Module]) -> None:
    """Each block's forward adds zero times the sum of its parameters to its output: the same output, and a
    gradient (zero where unused) for every parameter on every rank."""
    for block in blocks:
        block.register_forward_hook(_with_every_parameter)


def _with_every_parameter(module: nn.Module, args: Any, output: Any) -> Any:
    if not torch.is_grad_enabled():
        return output
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return output
    return _add_to_first_tensor(output, torch.stack([p.sum().float() for p in params]).sum() * 0.0)


def _add_to_first_tensor(output: Any, zero: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return output + zero.to(output.dtype)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (_add_to_first_tensor(output[0], zero), *output[1:])
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        return [_add_to_first_tensor(output[0], zero), *output[1:]]
    raise TypeError(
        f"{type(output).__name__} from a mixture-of-experts block: its first output should be a tensor (the hidden "
        "states) for every parameter to get a gradient on every rank"
    )


class SameModulesCheck:
    """The first micro-step's check that every rank ran the same modules: a module one rank skips (a routed expert
    the strategy does not know of) gives its parameters no gradient there, and the ranks' collectives no longer
    match. Compared once, after the first forward and before its backward's collectives; on a difference every rank
    raises one line naming the first such module and the ranks that did and did not run it."""

    def __init__(self, model: nn.Module, safe: list[nn.Module]) -> None:
        """`safe`: blocks whose skipped modules the strategy already handles (they are not compared)."""
        inside = {id(sub) for block in safe for sub in block.modules()}
        self.named = [
            (name, m)
            for name, m in model.named_modules()
            if id(m) not in inside and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self.done = not self.named
        self._ran: set[int] = set()

    @contextmanager
    def watch(self) -> Iterator[None]:
        if self.done:
            yield
            return
        handles = [m.register_forward_pre_hook(self._record) for _, m in self.named]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, module: nn.Module, args: Any) -> None:
        self._ran.add(id(module))

    def compare(self, device: torch.device, fix: str) -> None:
        if self.done:
            return
        import torch.distributed as dist

        self.done, named = True, self.named
        mine = torch.tensor([id(m) in self._ran for _, m in named], dtype=torch.uint8, device=device)
        self._ran = set()
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        ran = torch.stack(every).cpu()
        differ = (ran != ran[0]).any(dim=0).nonzero()
        if len(differ) == 0:
            return
        i = int(differ[0])
        did = [r for r in range(len(every)) if ran[r, i]]
        did_not = [r for r in range(len(every)) if not ran[r, i]]
        name, module = named[i]
        first = next(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        raise RuntimeError(
            f"parameter {f'{name}.{first}' if name else first} got no gradient on rank(s) {_ranks(did_not)} in the "
            f"first micro-step (its module did not run there) but did on rank(s) {_ranks(did)}: the ranks' "
            f"collectives would not match; {fix}"
        )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
