"""Tensor parallel under FSDP2: a mesh dimension of its own, inside each node, applied before sharding.

The ranks are a mesh of (data parallel) x T, the T consecutive ranks of a node one tensor-parallel group: they see
the same micro-batches and each holds 1/T of every layer the plan splits (`strategies.tp_plans`), through torch's
own `parallelize_module` (ColwiseParallel, RowwiseParallel). Every other parameter is replicated over the group as
a DTensor too, so that every parameter lives on one mesh (FSDP2 then shards each over the data-parallel dimension,
and the gradient norm is one reduction). torchtitan's order: tensor parallel, then checkpointing and compile, then
FSDP.

The activations' collectives (a rowwise layer's all-reduce in the forward, a colwise layer's in the backward) are
DTensor's functional collectives; a dispatch mode around the forward and the backward counts them
(`tp_comm_*` figures), beside FSDP's own counter.

With `loss_parallel` (strategy.loss_parallel) the output layer's logits stay split by vocabulary over the group and
the forward and the backward run inside torch's `loss_parallel()`, whose cross-entropy works on each rank's part
(torchtitan's default): no rank holds the whole logits. The model's outputs that every rank holds whole (its loss)
leave as plain tensors; the split logits leave as a DTensor, gathered whole only in evaluation (the metrics read
them) or by what reads them in training.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from strategies.comm import CommCounter
from strategies.tp_plans import SEQUENCE, check_plan, chosen_plan, fits, resolve, weight_dim

WHY_IN_NODE = (
    "its all-reduces of activations, several per layer per micro-step, need a node's links (NVLink: hundreds of "
    "GB/s), not the network's"
)


class TensorParallel:
    """The tensor-parallel dimension of an FSDP2 mesh: `size` ranks per group (1: none), the user's `plan` (None: the
    model's own), and whether a group may span nodes (`across_nodes`)."""

    def __init__(
        self, size: int, plan: Mapping[str, str] | None, across_nodes: bool, loss_parallel: bool = False
    ) -> None:
        self.size = int(size)
        self.loss_parallel = loss_parallel
        self.given = plan
        mapping = isinstance(plan, Mapping) and plan
        self.plan = {str(k): str(v) for k, v in plan.items()} if mapping else None  # None: the model's own
        self.across_nodes = across_nodes
        self.counter = CommCounter()
        self.counter.world_size = self.size

    def check(self, world_size: int, gpus: int | None, model: nn.Module, seq_len: int | None = None) -> None:
        """ValueError (one line) for a size or a plan this run cannot use (`seq_len`: the data's tokens per row, where
        known); the plan it will use, said in one line."""
        if self.given is not None and not isinstance(self.given, Mapping):
            raise ValueError(
                f"strategy.tp_plan={self.given} is not a mapping of module-name patterns to styles; e.g. "
                "strategy.tp_plan={blocks.*.mlp.0: colwise, blocks.*.mlp.2: rowwise}"
            )
        if self.size < 1:
            raise ValueError(f"strategy.tp_size={self.size} must be 1 (no tensor parallel) or more")
        if self.size == 1:
            if self.plan:
                raise ValueError("strategy.tp_plan is set but strategy.tp_size=1 splits nothing; set strategy.tp_size")
            if self.loss_parallel:
                raise ValueError(
                    "strategy.loss_parallel=true but strategy.tp_size=1 splits no logits; set strategy.tp_size, or "
                    "leave strategy.loss_parallel unset"
                )
            return
        if world_size % self.size:
            sizes = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ValueError(
                f"strategy.tp_size={self.size} does not divide the world size {world_size} (nodes x gpus); use one "
                f"of {sizes}"
            )
        per_node = gpus or world_size
        if self.size > per_node and not self.across_nodes:
            raise ValueError(
                f"strategy.tp_size={self.size} spans nodes of gpus={per_node}: {WHY_IN_NODE}; use strategy.tp_size="
                f"{max(d for d in range(1, per_node + 1) if per_node % d == 0 and world_size % d == 0)} or less, or "
                "strategy.tp_across_nodes=true to run it slowly"
            )
        resolved = check_plan(model, self.plan, self.size)
        _, where = chosen_plan(model, self.plan)
        if self.loss_parallel and output_layer(resolved) is None:
            raise ValueError(
                f"strategy.loss_parallel=true: {where} gathers no layer's output whole (colwise_rep or "
                "colwise_gather_output: the output layer whose logits loss_parallel keeps split); name the output "
                "layer so in strategy.tp_plan, or leave strategy.loss_parallel unset"
            )
        if seq_len and seq_len % self.size and any(style in SEQUENCE for style in resolved.values()):
            raise ValueError(
                f"data.seq_len={seq_len} does not split over strategy.tp_size={self.size}: {where} runs sequence "
                f"parallel (the sequence split over the group); use a data.seq_len that {self.size} divides, or a "
                "strategy.tp_plan without sequence styles"
            )
        modules = dict(model.named_modules())
        split = sum(weight_dim(style, modules[name]) is not None for name, style in resolved.items())
        sequence = sum(style in SEQUENCE and not style.startswith("rowwise") for style in resolved.values())
        also = f" and runs {sequence} on each rank's part of the sequence" if sequence else ""
        if self.loss_parallel:
            also += f"; the loss on {output_layer(resolved)}'s logits split by vocabulary (loss_parallel)"
        print(
            f"launch: tensor parallel over {self.size} ranks: {where} splits {split} modules of {type(model).__name__}"
            f"{also}; the rest is replicated over each group",
            flush=True,
        )

    def apply(self, model: nn.Module, mesh: Any) -> None:
        """Split the planned modules over `mesh` (torch's parallelize_module), replicate every other parameter over
        it, and tie again what was tied."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import parallelize_module

        plan, _ = chosen_plan(model, self.plan)
        modules = dict(model.named_modules())
        # A pipeline stage's stand-ins for the modules of other stages (`strategies.pipeline_stages`: an embedding
        # that makes zeros, Identity) are no module the style splits: kept as they are (`check_plan` refused the
        # style for the whole model's own modules before start).
        resolved = {name: style for name, style in resolve(model, plan).items() if fits(style, modules[name])}
        if self.loss_parallel:  # the whole model's (a pipeline's stages refuse it before start)
            resolved[str(output_layer(resolved))] = "colwise_loss"
            model.register_forward_hook(_local_outputs)
        tied: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                tied.setdefault(id(p), []).append((module, pname))
        styles = {name: _style(style) for name, style in resolved.items() if style != "replicate"}
        for name in (n for n, style in resolved.items() if style == "sequence_split"):
            model.get_submodule(name).register_forward_pre_hook(
                functools.partial(_whole_parts, self.size), with_kwargs=True
            )
        parallelize_module(model, mesh, styles)
        for module in model.modules():  # what no style split (a gathered module's own weights too): whole
            if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
                _replicate(module, mesh, Replicate())
        split = {id(modules[name]) for name in styles}
        for uses in (u for u in tied.values() if len(u) > 1):  # each module re-registered its own copy: one again,
            first, pname = next((u for u in uses if id(u[0]) in split), uses[0])  # a style's, where one split it
            for module, other in uses:
                if module is not first:
                    setattr(module, other, getattr(first, pname))

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Count the tensor-parallel collectives issued inside (forward, backward) in `counter`."""
        if self.size == 1:
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        with _Counting(self.counter), loss_parallel() if self.loss_parallel else nullcontext():
            yield

    def figures(self) -> dict[str, float]:
        """The last step's tensor-parallel collectives, as `tp_comm_*` figures; {} without tensor parallel."""
        if self.size == 1:
            return {}
        return {f"tp_{k}": v for k, v in self.counter.take().items()}


def output_layer(resolved: Mapping[str, str]) -> str | None:
    """The output layer of a resolved plan: the last module whose output it gathers whole after a colwise split (the
    GPT's head, a transformers model's lm_head), whose logits loss_parallel keeps split; None where there is none."""
    gathered = [name for name, style in resolved.items() if style in ("colwise_rep", "colwise_gather_output")]
    return gathered[-1] if gathered else None


def _local_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A model's outputs under loss_parallel: what every rank holds whole (the loss and its sum, DTensors of the
    cross-entropy over split logits) as plain tensors, its gradient kept; the split logits as they are, a DTensor,
    but in evaluation (no gradient), where they are gathered whole for the metrics that read them."""
    from torch.distributed.tensor import DTensor, Replicate

    def local(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        return value if torch.is_grad_enabled() else value.full_tensor()

    if isinstance(output, Mapping):  # a dict, a transformers ModelOutput (its items are its attributes)
        for key in list(output.keys()):
            output[key] = local(output[key])
        return output
    if isinstance(output, tuple):
        return tuple(local(v) for v in output)
    return local(output)


def _style(name: str) -> Any:
    """torch's style for a transformers style name (`strategies.tp_plans.STYLES`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    if name == "sequence_gather":  # a DTensor, whole: the colwise layers inside leave its gradient partial
        return _first_input_style()(Shard(1), Replicate(), use_local_output=False)
    if name == "sequence_split":
        return _first_input_style()(Replicate(), Shard(1), use_local_output=True)
    if name == "rowwise_sequence":
        return RowwiseParallel(output_layouts=Shard(1))
    if name in ("colwise", "embedding_colwise"):
        return ColwiseParallel() if name == "colwise" else ColwiseParallel(output_layouts=Replicate())
    if name == "colwise_loss":  # the output layer under loss_parallel: its logits split by vocabulary, a DTensor
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    return RowwiseParallel()


def first_input_name(module: nn.Module) -> str | None:
    """The name of the first parameter of a module's forward: how a caller that passes it by keyword names it
    (transformers' layers call their attention with `hidden_states=`)."""
    import inspect

    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return parameters[0].name if parameters and parameters[0].kind in positional else None


def _first_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A module's first input, given by position or by the name of its forward's first parameter; None: neither."""
    if args:
        return args[0]
    name = first_input_name(module)
    return kwargs.get(name) if name is not None else None


@functools.cache
def _first_input_style() -> Any:
    """torch's `ParallelStyle`, subclassed through its extension point (`_apply`): a module's first input, whether
    passed by position or by keyword, brought from one layout over the group to another (its other inputs as they
    are); torch's `PrepareModuleInput` reads inputs by position alone, or by keywords named ahead."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class FirstInput(ParallelStyle):
        def __init__(self, given: Any, wanted: Any, use_local_output: bool) -> None:
            super().__init__()
            self.given, self.wanted, self.use_local_output = given, wanted, use_local_output

        def _convert(self, t: Any, mesh: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            dt = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, (self.given,), run_check=False)
            if self.given != self.wanted:
                dt = dt.redistribute(placements=(self.wanted,))
            return dt.to_local() if self.use_local_output else dt

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            name = first_input_name(module)

            def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    return (self._convert(args[0], device_mesh), *args[1:]), kwargs
                if name is not None and name in kwargs:
                    return args, {**kwargs, name: self._convert(kwargs[name], device_mesh)}
                return None

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return FirstInput


def _whole_parts(size: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A sequence the group cannot split evenly is refused where it enters (an uneven part would be misread)."""
    first = _first_input(module, args, kwargs)
    if isinstance(first, torch.Tensor) and first.dim() > 1 and first.shape[1] % size:
        raise ValueError(
            f"sequence parallel over strategy.tp_size={size} ranks: a micro-batch of {first.shape[1]} tokens per row "
            f"does not split evenly; use a data.seq_len that {size} divides, or a plan without sequence styles"
        )


def _replicate(module: nn.Module, mesh: Any, replicate: Any) -> None:
    """The module's own parameters as DTensors replicated over `mesh`; its tensor inputs enter as replicated
    DTensors and its outputs leave as plain tensors (each rank computes the whole module)."""
    from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor

    def partition(name: str, mod: nn.Module, device_mesh: Any) -> None:
        if mod is not module:
            return
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                whole = nn.Parameter(distribute_tensor(p, device_mesh, [replicate]), requires_grad=p.requires_grad)
                mod.register_parameter(pname, whole)

    def inputs(mod: nn.Module, args: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(a, device_mesh, [replicate], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod: nn.Module, out: Any, device_mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, partition, inputs, outputs)


COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
"""DTensor's functional collectives (torch.ops._c10d_functional), by the counter's names."""


@functools.cache
def _counting_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self, counter: CommCounter) -> None:
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace == "_c10d_functional":
                kind = COLLECTIVES.get(func._opname)
                if kind is not None:
                    first = args[0]
                    nbytes = first.numel() * first.element_size()
                    if kind == "all_gather":  # the whole gathered buffer, as the counter takes it
                        nbytes *= self.counter.world_size
                    self.counter.record(nbytes, kind)
            return func(*args, **(kwargs or {}))

    return Counting


def _Counting(counter: CommCounter) -> Any:  # noqa: N802 - a class, built on first use (the dispatch machinery)
    return _counting_mode()(counter)
