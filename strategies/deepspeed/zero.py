"""Every place the DeepSpeed strategy reaches into DeepSpeed's ZeRO optimizers: the file to re-read on an upgrade.

- the strategy-neutral state export and import (full fp32 weights and optimizer moments keyed like torch's
  full state dict), including the lazily created optimizer state and the paging of NVMe partitions;
- the per-rank bytes of model state, read from the optimizer's partitions;
- the count of gradient reductions, by wrapping `deepspeed.comm`'s entry points.

Public helpers (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`, `GatheredParameters`) are used
where DeepSpeed has them; the attributes named here (`fp32_partitioned_groups_flat`, `averaged_gradients`,
`_optimizer_states_and_gradient_swap_in`, ...) are private and were checked against deepspeed 0.19.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from strategies.comm import CommCounter

REDUCTIONS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
)
"""DeepSpeed's reduction entry points (called as `deepspeed.comm.<name>` by the ZeRO optimizers)."""


# ------------------------------------------------------------------ communication


@contextmanager
def counting_reductions(counter: CommCounter) -> Iterator[None]:
    """Count the gradient reductions DeepSpeed issues inside the block (calls and input bytes)."""
    import deepspeed.comm as ds_comm

    originals = {name: getattr(ds_comm, name) for name in REDUCTIONS}

    def counted(fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            # The input is the last tensor argument (all_reduce(t), reduce_scatter_tensor(out, in)),
            # or the last list of tensors (all_reduce_coalesced, reduce_scatter(out, inputs)).
            args_ = [a for a in (*args, *kwargs.values()) if isinstance(a, (torch.Tensor, list, tuple))]
            payload = args_[-1] if args_ else []
            tensors = (
                [payload] if isinstance(payload, torch.Tensor) else [t for t in payload if isinstance(t, torch.Tensor)]
            )
            counter.calls += 1
            counter.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(ds_comm, name, counted(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(ds_comm, name, fn)


# ------------------------------------------------------------------ bytes held per rank


def gradient_bytes(engine: Any, stage: int, offloaded: bool) -> int:
    """This rank's reduced gradients as the optimizer is about to step (its 1/G partition)."""
    if offloaded:
        return 0  # reduced straight into host buffers for the CPU Adam
    opt = engine.optimizer
    left = sum(_nbytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    if stage == 3:
        return left + _nbytes(opt.grad_partitions_flat_buffer)
    return left + sum(_nbytes(t) for ts in opt.averaged_gradients.values() for t in ts if t is not None)


def state_bytes(engine: Any, stage: int, offload_optimizer: str, offload_params: str, grads: int) -> dict[str, float]:
    """Model state this rank holds on its device, and (estimated from partition sizes) what it offloaded."""
    opt, params = engine.optimizer, list(engine.module.parameters())
    gathered = sum(_nbytes(p.data) for p in params)  # stage 3: only parameters currently gathered
    if stage == 3:
        partition = sum(p.ds_tensor.ds_numel for p in params)
        shards = sum(p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in params)
        on_device = (0 if offload_params != "none" else shards) + gathered
        master = opt.fp32_partitioned_groups_flat
    else:
        partition = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
        shards, on_device = 0, gathered
        master = opt.single_partition_of_fp32_groups
    offloaded = shards if offload_params != "none" else 0
    if offload_optimizer == "none":
        moments = _tensors_bytes(opt.optimizer.state)
        on_device += grads + sum(_nbytes(t) for t in master) + moments
    else:
        offloaded += partition * (4 + 4 + 8)  # fp32 gradients, master weights, two Adam moments
    return {"model_state_bytes": float(on_device), "offloaded_state_bytes": float(offloaded)}


# ------------------------------------------------------------------ the strategy-neutral state


def _full_shape(p: torch.Tensor) -> torch.Size:
    return getattr(p, "ds_shape", p.shape)  # a ZeRO-3 parameter is an empty tensor between uses


def _owners(params: list[torch.Tensor], world_size: int) -> dict[int, int]:
    """Which rank holds each parameter's full copy in a checkpoint: the largest first, to the least loaded rank.
    The same on every rank; each holds about 1/G of the full state, so a node holds at most one full copy."""
    load, owner = [0] * world_size, {}
    for p in sorted(params, key=lambda p: -_full_shape(p).numel()):
        rank = min(range(world_size), key=load.__getitem__)
        owner[id(p)] = rank
        load[rank] += _full_shape(p).numel()
    return owner


def _buffer_names(module: torch.nn.Module) -> list[str]:
    """Persistent buffers: what torch's state dict holds (a DDP checkpoint has no others to load)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return [n for n in module.state_dict(keep_vars=True) if n not in params]


def export_state(engine: Any, stage: int, offload_optimizer: str) -> dict[str, Any]:
    """Full fp32 weights and optimizer state, keyed like torch's full state dict (collective).

    Streamed one parameter at a time: every rank takes part in gathering each parameter, only its owner
    (`_owners`) keeps the full copy. DCP writes the union of the ranks' entries, each once.
    """
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    create_optimizer_state(engine, stage, offload_optimizer)  # a template for loading holds the moments too
    module, inner = engine.module, engine.optimizer.optimizer
    rank, params = dist.get_rank(), list(module.parameters())
    owner = _owners(params, dist.get_world_size())
    keys = sorted({k for s in inner.state.values() for k in s if k != "step"})
    step = next((s["step"] for s in inner.state.values() if "step" in s), None)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    aliases: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)  # a tied parameter under every name, its state under the first
    for p in params:
        full = safe_get_full_fp32_param(p)  # collective under ZeRO-3
        moments = {k: safe_get_full_optimizer_state(p, k) for k in keys}
        if owner[id(p)] != rank:
            continue
        full = full.cpu()
        for n in aliases[id(p)]:
            model[n] = full
        if keys:
            first = aliases[id(p)][0]
            state[first] = {k: v.cpu() for k, v in moments.items()}
            if step is not None:
                state[first]["step"] = torch.tensor(float(step))
    if rank == 0:
        buffers = dict(module.named_buffers())
        model |= {n: buffers[n].detach().cpu() for n in _buffer_names(module)}
    zero = engine.optimizer
    members = zero.fp16_groups if stage == 3 else zero.bit16_groups  # each group's module parameters
    groups = []
    for group, group_params in zip(zero.param_groups, members):
        ids = {id(p) for p in group_params}
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [n for n, p in module.named_parameters() if id(p) in ids]})
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def import_state(engine: Any, stage: int, offload_optimizer: str, offload_params: str, state: dict[str, Any]) -> None:
    """Restore what `export_state` returned (each rank holding its owned entries), from any strategy and world size.

    Streamed one parameter at a time: its owner broadcasts the full value, every rank writes its own partition.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    create_optimizer_state(engine, stage, offload_optimizer)
    module, zero = engine.module, engine.optimizer
    rank, params = dist.get_rank(), list(module.named_parameters())
    owner = _owners([p for _, p in params], dist.get_world_size())
    weights, moments = state["model"], state["optim"]["state"]

    def full(name: str, p: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """The full value of `p` (its weight, or its optimizer state `key`), broadcast from its owner."""
        mine = owner[id(p)] == rank
        value = (weights[name] if key is None else moments[name][key]) if mine else None
        buffer = value.to(torch.float32).clone() if mine else torch.empty(_full_shape(p), dtype=torch.float32)
        dist.broadcast(buffer, src=owner[id(p)])
        return buffer

    keys = sorted({k for s in moments.values() for k in s if k != "step"}) if moments else []
    keys = _broadcast_list(keys)
    for name, p in params:  # the working copies (rounded, under bf16/fp16)
        value = full(name, p)
        # ZeRO-3: write into the gathered parameter; it is re-partitioned on leaving the block.
        gathered = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if stage == 3 else nullcontext()
        with gathered, torch.no_grad():
            p.copy_(value)
    if offload_params != "nvme":  # NVMe-offloaded working copies are not in host memory to copy from
        zero.refresh_fp32_params()
    for name, p in params:
        safe_set_full_fp32_param(p, full(name, p))  # the exact fp32 master
        for key in keys:
            safe_set_full_optimizer_state(p, full(name, p, key), key)
    steps = [s["step"] for s in moments.values() if "step" in s]
    step = _broadcast_list([float(steps[0])] if steps else [])
    if step:
        _set_step(zero.optimizer, int(step[0]))


def _broadcast_list(values: list[Any]) -> list[Any]:
    """Rank 0's list on every rank (rank 0 always owns the largest parameter, so it holds an entry of each kind)."""
    import torch.distributed as dist

    box = [values]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def create_optimizer_state(engine: Any, stage: int, offload_optimizer: str) -> None:
    """Create the optimizer's state before its first step (zero moments at step 0: a fresh start).

    DeepSpeed, like torch, creates it lazily; a checkpoint template and a load need it now. One
    zero-gradient step at learning rate 0 creates it and changes no weight.
    """
    zero = engine.optimizer
    inner = zero.optimizer
    # Each fp32 master partition and the index of its param group (ZeRO-3 puts a sub-group's
    # partition into its group only while stepping it).
    if stage == 3:
        masters = [(p, zero.sub_group_to_group_id[i]) for i, p in enumerate(zero.fp32_partitioned_groups_flat)]
    else:
        masters = [(p, i) for i, p in enumerate(zero.single_partition_of_fp32_groups)]
    if all(inner.state.get(p) for p, _ in masters):
        return
    for i, (p, index) in enumerate(masters):
        # On NVMe a partition's master and moments live on disk (DeepSpeed keeps small ones in host
        # memory): page them in around the step, as its own step does; paging out writes the new moments.
        paged = offload_optimizer == "nvme" and zero._swappable_optimizer_subgroup(i)
        if paged:
            zero._optimizer_states_and_gradient_swap_in(i)
        group = inner.param_groups[index]
        params, lr, grad = group["params"], group["lr"], p.grad  # with offload, .grad is DeepSpeed's host buffer
        group["params"], group["lr"], p.grad = [p], 0.0, torch.zeros_like(p)
        inner.step()
        group["params"], group["lr"], p.grad = params, lr, grad
        if paged:
            zero._optimizer_states_and_gradient_swap_out(i)
    _set_step(inner, 0)
    if stage < 3:
        # DeepSpeed links each parameter to its slice of the optimizer state after its first
        # step; the state exists now, so link it now (ZeRO-3 looks slices up on each access).
        zero._lazy_init_hp_params_optimizer_state()


def _set_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Set the step count of every parameter's state (a tensor in torch's optimizers, an int in DeepSpeed's)."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.full_like(state["step"], step) if isinstance(state["step"], torch.Tensor) else step


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors_bytes(state: dict[Any, dict[str, Any]]) -> int:
    """Optimizer state tensors (moments), not the scalar step counters."""
    return sum(_nbytes(t) for s in state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
