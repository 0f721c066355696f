"""A pipeline stage as a module: the whole model, pruned to the stage's layers under the whole model's names, run by
its own forward from the activation received (`Stage`); and torch's pieces the strategy runs it with (its
`PipelineStage`, counting what it sends; the schedule classes by name)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from strategies.pipeline_layout import Split


class ZeroEmbedding(nn.Module):
    """An embedding a later stage does not compute: zeros of its width (the first kept layer's input replaces what
    the forward makes of them). It keeps its weight where the stage uses it elsewhere (a tied head), under the whole
    model's first name; its class name says embedding to the param groups' rules, as the module it stands for."""

    def __init__(self, dim: int, dtype: torch.dtype, weight: nn.Parameter | None) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype
        if weight is not None:
            self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class _Done(Exception):
    """Raised by the last kept layer of a stage that is not the last: its hidden state is the stage's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def prune(whole: nn.Module, split: Split, index: int) -> nn.Module:
    """A deep copy of `whole` holding stage `index`'s modules, under the whole model's names."""
    model = copy.deepcopy(whole)
    first, last = index == 0, index == len(split.ranges) - 1
    lo, hi = split.ranges[index]
    layers = model.get_submodule(split.path)
    kept = nn.ModuleList()
    for i in range(lo, hi):
        kept.add_module(str(i), layers[i])
    model.set_submodule(split.path, kept)
    held = {id(p) for p in kept.parameters()}
    for name, role in split.roles.items():
        if (role == "pre" and first) or (role == "post" and last):
            held |= {id(p) for p in model.get_submodule(name).parameters(recurse=False)}
    for name, role in split.roles.items():
        module = model.get_submodule(name)
        if role == "pre" and not first:
            if isinstance(module, nn.Embedding):
                tied = module.weight if id(module.weight) in held else None  # the head's: kept, under its first name
                stub = ZeroEmbedding(module.embedding_dim, module.weight.dtype, tied)
                model.set_submodule(name, stub)
            else:
                model.set_submodule(name, nn.Identity())
        elif role == "post" and not last:
            model.set_submodule(name, nn.Identity())
    return model


def _hidden(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


class Stage(nn.Module):
    """One pipeline stage: the pruned copy's children under their own names, run by the copy's own forward with the
    received activation put in as the first kept layer's input, and stopped after the last kept layer."""

    def __init__(self, pruned: nn.Module, split: Split, index: int) -> None:
        super().__init__()
        if any(True for _ in pruned.parameters(recurse=False)):
            raise ValueError(f"{type(pruned).__name__} holds parameters of its own (not in a module)")
        for name, child in pruned.named_children():
            self.add_module(name, child)
        self._run = (pruned,)  # not registered: its children are this module's
        self.index, self.count = index, len(split.ranges)
        self.is_first, self.is_last = index == 0, index == self.count - 1
        kept = list(pruned.get_submodule(split.path))
        self._ends = (kept[0], kept[-1])
        self._received: torch.Tensor | None = None
        self._spec: Any = None
        self._tensors: list[bool] = []

    def hook(self) -> None:
        """After sharding: FSDP's hooks are in place, this one goes first for the first layer."""
        if not self.is_first:
            self._ends[0].register_forward_pre_hook(self._inject, with_kwargs=True, prepend=True)
        if not self.is_last:
            self._ends[1].register_forward_hook(self._stop)

    def _inject(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self._received}
        return (self._received, *args[1:]), kwargs

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        raise _Done(_hidden(output))

    def train(self, mode: bool = True) -> Stage:
        super().train(mode)
        self._run[0].train(mode)
        return self

    def forward(self, *received: torch.Tensor, **batch: Any) -> Any:
        self._received = received[0] if received else None
        try:
            output = self._run[0](**batch)
        except _Done as done:
            return done.hidden
        finally:
            self._received = None
        leaves, self._spec = pytree.tree_flatten(output)
        self._tensors = [isinstance(t, torch.Tensor) for t in leaves]
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The model's own output from the last stage's tensors (its other leaves: None)."""
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else None for t in self._tensors], self._spec)


def counted_stage_class() -> Any:
    """torch's PipelineStage counting what it sends to another rank (`pp_sent_bytes`): the activations of its
    forward and their gradients in its backward, through the methods its schedule asks for the sends
    (`get_fwd_send_ops`, `get_bwd_send_ops`); a stage next to it on the same rank (zbv's turn) is handed its input
    in memory, with no send."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        sent = 0

        def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
            me = dist.get_rank()
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.peer != me)
            return ops

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
            return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
            return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    return CountedStage


def schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import schedules as s

    return {
        "gpipe": s.ScheduleGPipe,
        "1f1b": s.Schedule1F1B,
        "interleaved_1f1b": s.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": s.ScheduleInterleavedZeroBubble,
        "zbv": s.ScheduleZBVZeroBubble,
    }[name]
