"""DeepSpeed's adapter: every place the DeepSpeed strategy reaches into DeepSpeed beyond its public API, checked
against deepspeed 0.19.8; the file to re-read on an upgrade.

- the strategy-neutral state export and import (full fp32 weights and optimizer moments keyed like torch's
  full state dict), including the lazily created optimizer state and the paging of NVMe partitions;
- the per-rank bytes of model state, read from the optimizer's partitions;
- the count of collectives (`counting_collectives`), by wrapping `deepspeed.comm`'s entry points inside a block.
  DeepSpeed's own comms logger (`deepspeed.comm.configure`, the `comms_logger` config) counts the same calls but
  not the same figures: it sizes a gather by its input, not the buffer gathered, a coalesced all-reduce by the sum
  of its tensors; and once enabled it synchronises the device after every collective and keeps each one's latency.

Public helpers (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`, `GatheredParameters`) are used
where DeepSpeed has them. The private methods called here, and the entry points wrapped, are checked once per
process before the strategy relies on them (`check_deepspeed`, from its setup): one that is gone or takes other
parameters fails in one line naming it, DeepSpeed's version and what to do. The attributes read here
(`fp32_partitioned_groups_flat`, `averaged_gradients`, `single_partition_of_fp32_groups`, ...) are the ZeRO
optimizers' own, read where the tests of each stage read their figures.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from strategies.checked import Private, check
from strategies.comm import CommCounter
from strategies.no_grad import NO_GRAD_GROUP

CHECKED_AGAINST = "0.19.8"
ADAPTER = "strategies/deepspeed/zero.py"

COLLECTIVES = {
    "all_reduce": ("all_reduce", True),
    "all_reduce_coalesced": ("all_reduce", True),
    "reduce": ("reduce", True),
    "reduce_scatter": ("reduce_scatter", True),
    "reduce_scatter_fn": ("reduce_scatter", True),
    "reduce_scatter_tensor": ("reduce_scatter", True),
    "all_gather": ("all_gather", False),
    "all_gather_into_tensor": ("all_gather", False),
    "allgather_fn": ("all_gather", False),
    "all_to_all_single": ("all_to_all", False),  # a mixture of experts' tokens to and from their experts' ranks
    "all_to_all": ("all_to_all", False),
}
"""DeepSpeed's collective entry points (called as `deepspeed.comm.<name>` by the ZeRO optimizers): what each is for
the ring formula, and whether it synchronises gradients (the all-gathers move parameters, the all-to-alls tokens)."""
ENTRY_POINTS = {
    "all_reduce": ("tensor", "op", "group", "async_op", "prof", "log_name", "debug"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op", "prof", "log_name", "debug"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "prof", "log_name", "debug"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op", "prof", "log_name", "debug"),
    "reduce_scatter_fn": ("output_tensor", "tensor", "op", "group", "async_op", "prof", "debug"),
    "reduce_scatter_tensor": ("output_tensor", "tensor", "op", "group", "async_op", "prof", "log_name", "debug"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op", "prof", "log_name", "debug"),
    "all_gather_into_tensor": ("output_tensor", "tensor", "group", "async_op", "prof", "log_name", "debug"),
    "allgather_fn": ("output_tensor", "input_tensor", "group", "async_op", "debug"),
    "all_to_all_single": (
        "output",
        "tensor",
        "output_split_sizes",
        "input_split_sizes",
        "group",
        "async_op",
        "prof",
        "log_name",
        "debug",
    ),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op", "prof", "log_name", "debug"),
}
"""What each entry point takes: the counter sizes a call by the largest of its tensor arguments, which is the full
buffer (a reduction's input, a gather's output) for these parameters; a new tensor parameter could change that."""
ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
ZERO_3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
PRIVATE = (
    *(Private(f"deepspeed.comm:{name}", parameters) for name, parameters in ENTRY_POINTS.items()),
    Private(
        "deepspeed.utils.mixed_precision_linkage:lazy_init_hp_params_optimizer_state",
        ("lp_param_list", "flat_hp_partition", "optimizer_state"),
    ),
    Private(f"{ZERO_1_2}._link_all_hp_params", ("self",)),
    Private(f"{ZERO_3}._swappable_optimizer_subgroup", ("self", "sub_group_id")),
    Private(f"{ZERO_3}._optimizer_states_and_gradient_swap_in", ("self", "sub_group_id", "timer_names")),
    Private(f"{ZERO_3}._optimizer_states_and_gradient_swap_out", ("self", "sub_group_id", "timer_names")),
)
"""Every name of DeepSpeed's this module wraps or calls that is not its public API, with what it takes."""


def check_deepspeed(where: Any = None) -> None:
    """LibraryChanged, in one line, where the installed DeepSpeed lacks a name of `PRIVATE` or it takes other
    parameters (once per process; `where`: a stand-in to check instead, in the tests)."""
    if where is not None:
        check("deepspeed", CHECKED_AGAINST, PRIVATE, ADAPTER, where)
    else:
        _check_installed()


@functools.cache
def _check_installed() -> None:
    check("deepspeed", CHECKED_AGAINST, PRIVATE, ADAPTER)


# ------------------------------------------------------------------ communication


@contextmanager
def counting_collectives(counter: CommCounter, gathers_only: bool = False) -> Iterator[None]:
    """Count the collectives DeepSpeed issues inside the block: each one's full buffer (the largest of its tensor
    arguments: the input of a reduction, the output of a gather), and the ring bytes sent for it. `gathers_only`:
    the optimizer step, whose reductions are scalars (norms, overflow flags), not a gradient synchronisation."""
    import deepspeed.comm as ds_comm

    originals = {name: getattr(ds_comm, name) for name in COLLECTIVES}

    def counted(name: str, fn: Any) -> Any:
        collective, sync = COLLECTIVES[name]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            sizes = [
                _nbytes(a) if isinstance(a, torch.Tensor) else sum(_nbytes(t) for t in a)
                for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor)
                or (isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a))
            ]
            counter.record(max(sizes, default=0), collective, sync)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        if not gathers_only or not COLLECTIVES[name][1]:
            setattr(ds_comm, name, counted(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(ds_comm, name, fn)


# ------------------------------------------------------------------ bytes held per rank


def gradient_bytes(engine: Any, stage: int) -> int:
    """This rank's reduced gradients as the optimizer is about to step (its 1/G partition): on the device, or, when
    the optimizer is offloaded, the fp32 host buffers DeepSpeed reduces them into for its CPU Adam."""
    opt = engine.optimizer
    if offloaded(engine, stage)[0]:
        return 4 * _partition_numel(engine, stage)
    left = sum(_nbytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    if stage == 3:
        return left + _nbytes(opt.grad_partitions_flat_buffer)
    return left + sum(_nbytes(t) for ts in opt.averaged_gradients.values() for t in ts if t is not None)


def offloaded(engine: Any, stage: int) -> tuple[bool, bool]:
    """Whether DeepSpeed itself moved the optimizer's state and the parameters' partitions off the device, as its
    ZeRO optimizer decided them (not as the launcher's config asked)."""
    opt = engine.optimizer
    if stage == 3:
        return bool(opt.offload_optimizer), bool(opt.offload_param)
    return bool(opt.cpu_offload), False


def _partition_numel(engine: Any, stage: int) -> int:
    """Elements of this rank's fp32 master partition (as DeepSpeed sizes it, swapped out or not)."""
    opt = engine.optimizer
    if stage == 3:
        return int(sum(opt.fp16_partitioned_groups_flat_numel))
    return int(sum(t.numel() for t in opt.single_partition_of_fp32_groups))


def state_bytes(engine: Any, stage: int, grads: int) -> tuple[float, float]:
    """Model state this rank holds on its device, and what DeepSpeed offloaded (read from its own partitions)."""
    opt, params = engine.optimizer, list(engine.module.parameters())
    optimizer_off, params_off = offloaded(engine, stage)
    gathered = sum(_nbytes(p.data) for p in params)  # stage 3: only parameters currently gathered
    shards = sum(p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in params) if stage == 3 else 0
    master_bytes = 4 * _partition_numel(engine, stage)  # fp32; on NVMe swapped out between steps, its size then
    moments = _tensors_bytes(opt.optimizer.state)
    if optimizer_off and moments < 2 * master_bytes:  # swapped to NVMe (placeholders here): CPU Adam's two moments
        moments = 2 * master_bytes
    optimizer_state = grads + master_bytes + moments
    on_device = gathered + (0 if params_off else shards) + (0 if optimizer_off else optimizer_state)
    off = (shards if params_off else 0) + (optimizer_state if optimizer_off else 0)
    return float(on_device), float(off)


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


def export_state(engine: Any, stage: int, offload_optimizer: str, ema: Any = None) -> dict[str, Any]:
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
        # Collectives under ZeRO-3. A frozen parameter has no fp32 master and no optimizer state: its weight is the
        # module's own (gathered under ZeRO-3, where frozen parameters are partitioned too).
        full = safe_get_full_fp32_param(p) if p.requires_grad else _gathered(p, stage)
        moments = {k: safe_get_full_optimizer_state(p, k) for k in keys} if p.requires_grad else {}
        if owner[id(p)] != rank:
            continue
        full = full.cpu()
        for n in aliases[id(p)]:
            model[n] = full
        if keys and p.requires_grad:
            first = aliases[id(p)][0]
            state[first] = {k: v.cpu() for k, v in moments.items()}
            if step is not None:
                state[first]["step"] = torch.tensor(float(step))
    if rank == 0:
        buffers = dict(module.named_buffers())
        model |= {n: buffers[n].detach().cpu() for n in _buffer_names(module)}
    groups: list[dict[str, Any]] = []
    members: dict[int, set[int]] = {}
    for index, (group, ids) in enumerate(zip(inner.param_groups, _group_members(engine, stage))):
        # The strategy's own groups (`without_decay`): listed in the group they came from, as every other strategy has
        # them.
        members.setdefault(group.get(NO_GRAD_GROUP, index), set()).update(ids)
        if NO_GRAD_GROUP not in group:
            groups.append({k: v for k, v in group.items() if k != "params"})
    for index, group in enumerate(groups):
        group["params"] = [n for n, p in module.named_parameters() if id(p) in members[index]]
    exported = {"model": model, "optim": {"state": state, "param_groups": groups}}
    if ema is not None:  # the average's full values, kept by each parameter's owner like its weight
        weights = {}
        for n, p in module.named_parameters():
            if n in ema.average:
                full = _whole(ema.average[n], p, stage)  # collective under ZeRO-3
                if owner[id(p)] == rank:
                    weights[n] = full.cpu()
        exported["ema"] = {"weights": weights, "steps": ema.steps}
    return exported


def ema_live(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """What this rank holds of each trainable parameter, for the EMA to average (`strategies.ema`): the parameter
    itself (ZeRO-1/2: whole on every rank), or its partition (ZeRO-3: `ds_tensor`, from which each forward gathers)."""
    return {n: p.ds_tensor if stage == 3 else p for n, p in engine.module.named_parameters() if p.requires_grad}


def _whole(part: torch.Tensor, p: torch.Tensor, stage: int) -> torch.Tensor:
    """The full tensor of which `part` is this rank's ZeRO-3 partition (collective), or `part` itself (ZeRO-1/2)."""
    import torch.distributed as dist

    if stage != 3:
        return part
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part.contiguous())
    return torch.cat([t.reshape(-1) for t in parts])[: _full_shape(p).numel()].view(_full_shape(p))


def _partition(full: torch.Tensor, part: torch.Tensor, stage: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 partition of `full` (the rank's slice of the flat tensor, zero-padded), or `full` itself."""
    if stage != 3:
        return full
    n = part.numel()
    chunk = full.reshape(-1)[rank * n : (rank + 1) * n]
    return torch.nn.functional.pad(chunk, (0, n - chunk.numel())).to(part.dtype).view_as(part)


def _gathered(p: torch.Tensor, stage: int) -> torch.Tensor:
    """A parameter's full value in fp32, as the module holds it (collective under ZeRO-3)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([p]) if stage == 3 else nullcontext():
        return p.detach().to(torch.float32, copy=True)


def _group_members(engine: Any, stage: int) -> list[set[int]]:
    """The module parameters of each of the optimizer's param groups (ZeRO-3 splits a group into sub-groups)."""
    zero = engine.optimizer
    if stage != 3:
        return [{id(p) for p in group} for group in zero.bit16_groups]
    members: list[set[int]] = [set() for _ in zero.optimizer.param_groups]
    for sub, group_params in enumerate(zero.fp16_groups):
        members[zero.sub_group_to_group_id[sub]] |= {id(p) for p in group_params}
    return members


def import_state(
    engine: Any, stage: int, offload_optimizer: str, offload_params: str, state: dict[str, Any], ema: Any = None
) -> None:
    """Restore what `export_state` returned (each rank holding its owned entries), from any strategy and world size:
    the weights of every parameter, the fp32 masters and optimizer state of the trainable ones.

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

    def full_of(entries: dict[str, Any], name: str, p: torch.Tensor) -> torch.Tensor:
        """The full value of `p` in `entries` (weights, the EMA's), broadcast from its owner."""
        mine = owner[id(p)] == rank
        buffer = entries[name].to(torch.float32).clone() if mine else torch.empty(_full_shape(p), dtype=torch.float32)
        dist.broadcast(buffer, src=owner[id(p)])
        return buffer

    def full(name: str, p: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """The full value of `p` (its weight, or its optimizer state `key`), broadcast from its owner."""
        mine = owner[id(p)] == rank
        # A parameter that never got a gradient under ddp or fsdp has no optimizer state there: zero moments here.
        value = (weights[name] if key is None else moments.get(name, {}).get(key)) if mine else None
        if mine and value is None:
            value = torch.zeros(_full_shape(p))
        buffer = value.to(torch.float32).clone() if mine else torch.empty(_full_shape(p), dtype=torch.float32)
        dist.broadcast(buffer, src=owner[id(p)])
        return buffer

    keys = sorted({k for s in moments.values() for k in s if k != "step"}) if moments else []
    keys = sorted({k for ks in _every_rank(keys) for k in ks})
    for name, p in params:  # the working copies (rounded, under bf16/fp16)
        value = full(name, p)
        # ZeRO-3: write into the gathered parameter; it is re-partitioned on leaving the block.
        gathered = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if stage == 3 else nullcontext()
        with gathered, torch.no_grad():
            p.copy_(value)
    if offload_params != "nvme":  # NVMe-offloaded working copies are not in host memory to copy from
        zero.refresh_fp32_params()
    for name, p in params:
        if not p.requires_grad:  # frozen: its weight above is all there is
            continue
        safe_set_full_fp32_param(p, full(name, p))  # the exact fp32 master
        for key in keys:
            safe_set_full_optimizer_state(p, full(name, p, key), key)
    if ema is not None:  # the average's partitions; from a checkpoint without one, the loaded weights
        averaged = state.get("ema", {}).get("weights")
        with torch.no_grad():
            for name, p in params:
                if name in ema.average:
                    if averaged is None:
                        ema.average[name].copy_(ema.live[name])
                        continue
                    value = full_of(averaged, name, p)
                    ema.average[name].copy_(_partition(value, ema.average[name], stage, rank))
            if "ema" in state:
                ema.steps.copy_(state["ema"]["steps"])
    steps = [s["step"] for s in moments.values() if "step" in s]
    step = next((s for s in _every_rank([float(steps[0])] if steps else []) if s), None)
    if step:
        _set_step(zero.optimizer, int(step[0]))


def _every_rank(values: list[Any]) -> list[list[Any]]:
    """Each rank's list, on every rank: a rank may own no trainable parameter, and so no optimizer state."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def create_optimizer_state(engine: Any, stage: int, offload_optimizer: str) -> None:
    """Create the optimizer's state before its first step (zero moments at step 0: a fresh start), and under ZeRO-1/2
    link every parameter to its slice of it, before each export and import.

    DeepSpeed, like torch, creates it lazily; a checkpoint template and a load need it now. A zero-gradient step of
    each partition's group alone, at learning rate 0 and no weight decay (Adam's adds it to the gradient), changes no
    weight or moment; a step of all groups would step the others' partitions too, which under offload hold gradients.
    """
    zero = engine.optimizer
    inner = zero.optimizer
    # Each fp32 master partition and its group's index (ZeRO-3 puts a sub-group's partition in its group to step it).
    if stage == 3:
        masters = [(p, zero.sub_group_to_group_id[i]) for i, p in enumerate(zero.fp32_partitioned_groups_flat)]
    else:
        masters = [(p, i) for i, p in enumerate(zero.single_partition_of_fp32_groups)]
    if not all(inner.state.get(p) for p, _ in masters):
        _step_at_zero(zero, masters, offload_optimizer)
    if stage < 3:
        _link_optimizer_state(zero)


def _step_at_zero(zero: Any, masters: list[tuple[torch.Tensor, int]], offload_optimizer: str) -> None:
    """The optimizer's state made by a step of zero gradients at learning rate 0, one partition at a time; its step
    count 0."""
    inner = zero.optimizer
    for i, (p, index) in enumerate(masters):
        # On NVMe a partition's master and moments live on disk (DeepSpeed keeps small ones in host
        # memory): page them in around the step, as its own step does; paging out writes the new moments.
        paged = offload_optimizer == "nvme" and zero._swappable_optimizer_subgroup(i)
        if paged:
            zero._optimizer_states_and_gradient_swap_in(i)
        group = inner.param_groups[index]
        alone = {**group, "params": [p], "lr": 0.0} | ({"weight_decay": 0.0} if "weight_decay" in group else {})
        groups, grad, p.grad, inner.param_groups = inner.param_groups, p.grad, torch.zeros_like(p), [alone]
        inner.step()
        inner.param_groups, p.grad = groups, grad
        if paged:
            zero._optimizer_states_and_gradient_swap_out(i)
    _set_step(inner, 0)


def _link_optimizer_state(zero: Any) -> None:
    """ZeRO-1/2: each parameter's fragment linked to its slice of its group's optimizer state as it is now, in every
    group (ZeRO-3 looks slices up on each access).

    DeepSpeed links them once, in its first step, right after the step of its first param group (`_optimizer_step`),
    when the other groups have no state yet: their parameters keep empty fragments for the rest of the run, and
    `safe_get_full_optimizer_state` raises "exp_avg not found in optimizer state fragment" for each of them (the group
    with weight decay, the second) where no export or import came before that step. One taken before it (a
    checkpoint's room check, a resume) had made every group's state first. A link is a view per parameter: made again
    at each export and import, it also follows state that was replaced (`regroup_adagrad`).
    """
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    for params, master in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
        lazy_init_hp_params_optimizer_state(params, master, zero.optimizer.state)


def regroup_adagrad(engine: Any, stage: int, groups: list[dict[str, Any]]) -> None:
    """DeepSpeed 0.19 rebuilds a client Adagrad over its fp32 partitions in one param group, losing the client's (it
    fails at the first reduction): rebuilt with each partition in its own group, and the parameters linked again."""
    zero = engine.optimizer
    if not isinstance(zero.optimizer, torch.optim.Adagrad) or len(groups) < 2:
        return
    if stage == 3:
        members = [
            [p for i, p in enumerate(zero.fp32_partitioned_groups_flat) if zero.sub_group_to_group_id[i] == g]
            for g in range(len(groups))
        ]
    else:
        members = [[p] for p in zero.single_partition_of_fp32_groups]
    zero.optimizer = torch.optim.Adagrad([{**g, "params": ps} for g, ps in zip(groups, members, strict=True)])
    if stage < 3:
        zero._link_all_hp_params()


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
