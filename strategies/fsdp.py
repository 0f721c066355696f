"""Native FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded 1/G per rank.

Each sharding unit (by default each GPT `Block`) is sharded on its own, then the root takes
what is left (embeddings, final norm). A unit's parameters are all-gathered just before its
forward and backward, and its gradients reduce-scattered right after its backward.

HSDP is the same class over a 2-D mesh (`strategy.replicate_size` > 1): state is sharded 1/S within each
shard group of S ranks, the groups are replicas, and after each unit's reduce-scatter FSDP2 all-reduces the
rank's 1/S gradient shard across the replicate group. `strategy.tp_size` > 1 adds a last, tensor-parallel dimension
(`strategies.tensor_parallel`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from strategies.base import ModelFactory, OptimizerFactory, RunContext, call_model
from strategies.batchnorm import sync_batchnorm
from strategies.comm import CommCounter
from strategies.declarations import Collective, Conformance, Layout, Mesh, Placement, Requirements, Transients
from strategies.ema import averaged, ema_of
from strategies.held import check_held, fill_held, held_tensors
from strategies.moe import (
    SameModulesCheck,
    block_classes,
    check_moe_blocks,
    moe_blocks,
    units_inside,
    use_every_parameter,
)
from strategies.parallelize import apply_ac, apply_compile, apply_fsdp, apply_tp, device_meshes
from strategies.state import load_torch_state_dict, torch_state_dict
from strategies.stepping import autocast_dtype, optimizer_step, scaler_scale, step_figures
from strategies.tensor_parallel import TensorParallel
from strategies.units import tied_unit_lines, unit_classes, unit_modules

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_WEIGHT_BUFFERS = 2
"""Units gathered at once: the one computing and the next, prefetched."""
UNIT_GRAD_BUFFERS = 2
"""Unit-sized gradient buffers: the unsharded gradients and the reduce-scatter's flat input."""


def _counting_collectives(counter: CommCounter) -> tuple[Any, Any]:
    """FSDP2's default reduce-scatter and all-gather, counted: installed through the public
    `set_custom_reduce_scatter` and `set_custom_all_gather`. The reduce-scatters synchronise gradients; the
    all-gathers of parameters (before each unit's forward and backward) count in the bytes sent.

    Built on first use: importing FSDP2's modules costs about a second, which `launch plan` and
    `launch --help` must not pay (they only read this strategy's layout).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountingReduceScatter(ReduceScatter):
        def __init__(self) -> None:
            self.inner = DefaultReduceScatter()

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            counter.record(input_tensor, "reduce_scatter")  # the unit's whole (padded) gradient, in reduce_dtype
            return self.inner(output_tensor, input_tensor, group, op, async_op)

    class CountingAllGather(AllGather):
        def __init__(self) -> None:
            self.inner = DefaultAllGather()

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            counter.record(output_tensor, "all_gather", sync=False)  # the unit's whole (padded) parameters
            return self.inner(output_tensor, input_tensor, group, async_op)

    return CountingReduceScatter(), CountingAllGather()


def _counting_all_reduce(counter: CommCounter, replicas: int) -> Any:
    """An all-reduce hook (`set_all_reduce_hook`): under HSDP FSDP2 calls it with the output of its own all-reduce
    across the replicate group (a gradient shard, in reduce_dtype), only when that all-reduce ran."""

    def hook(reduced: torch.Tensor) -> None:
        counter.record(reduced, "all_reduce", ranks=replicas)

    return hook


class FSDP:
    stages_model = False
    """It splits the model into pipeline stages (`strategies.pipeline.PipelineFSDP`, built by
    `strategies.sharded.fsdp` where strategy.pp_size > 1)."""

    def __init__(  # every option's default is its schema's (launcher/config/schema.py), written there alone
        self,
        *,
        shard_units: list[str] | None,
        reshard_after_forward: bool,
        sync_batchnorm: bool,
        offload: str,
        reduce_dtype: str,
        activation_checkpointing: bool,
        sync_each_microbatch: bool,
        shard_size: int | None,
        replicate_size: int | None,
        moe_blocks: list[str] | None,
        tp_size: int,
        tp_plan: dict[str, str] | None,
        tp_across_nodes: bool,
        loss_parallel: bool,
        pp_size: int,
        pp_schedule: str,
        pp_stages_per_rank: int | None,
        pp_split: list[int] | None,
        pp_balance: str,
        pp_across_nodes: bool,
    ) -> None:
        if pp_size > 1 and not self.stages_model:
            raise ValueError(
                f"strategy.pp_size={pp_size} with strategy._target_=strategies.fsdp.FSDP: FSDP alone has no pipeline "
                "stages; use strategy._target_=strategies.sharded.fsdp (strategy=fsdp, hsdp or fsdp_tp)"
            )
        self.mesh = Mesh(shard_size, replicate_size, tp_size)
        self.pp_size, self.pp_schedule, self.pp_stages_per_rank = pp_size, pp_schedule, pp_stages_per_rank
        self.pp_split, self.pp_balance = None if pp_split is None else [int(i) for i in pp_split], pp_balance
        self.pp_across_nodes = pp_across_nodes  # weighed by the parent (`launcher.plan.pipeline.check_pipeline_nodes`)
        self.tp = TensorParallel(tp_size, tp_plan, tp_across_nodes, loss_parallel)
        self.shard_units = None if shard_units is None else [str(name) for name in shard_units]
        self.reshard_after_forward = reshard_after_forward
        self.sync_batchnorm = sync_batchnorm
        self.offload = offload
        self.reduce_dtype = reduce_dtype
        self.activation_checkpointing = activation_checkpointing
        self.sync_each_microbatch = sync_each_microbatch
        self.moe_blocks = None if moe_blocks is None else [str(name) for name in moe_blocks]
        self._counter = CommCounter()
        self._last_step: dict[str, float] = {}

    def layout(self) -> Layout:
        # With CPU offload the optimizer steps on the host copies too: all three live there.
        placed = Placement(sharded=True, where="cpu" if self.offload == "cpu" else "device")
        transients = Transients(
            unit_weights=UNIT_WEIGHT_BUFFERS if self.reshard_after_forward else UNIT_WEIGHT_BUFFERS + 1,
            unit_grads=UNIT_GRAD_BUFFERS,
            full_grads_accumulating=0.0 if self.sync_each_microbatch else 1.0,  # unsharded until the last micro-step
        )
        return Layout(params=placed, grads=placed, optimizer=placed, transients=transients, mesh=self.mesh)

    def collectives(
        self, params: float, precision: str, accumulation: int, world_size: int, gpus: int | None, reused: float = 0
    ) -> list[Collective]:
        """Per unit, summed over the model: its parameters all-gathered (in the compute dtype) before each micro-step's
        forward and, resharded after it, again before its backward; its gradient reduce-scattered (in reduce_dtype)
        once per step, or every micro-step under sync_each_microbatch; on an HSDP mesh the gradient shard (1/S)
        all-reduced across the replicas as often."""
        replicate, shard = self.mesh.groups(world_size, gpus)
        weights = "fp32" if autocast_dtype(precision) is None else precision
        syncs = accumulation if self.sync_each_microbatch else 1
        gathers = accumulation * (2 if self.reshard_after_forward else 1)
        found = [
            Collective("all_gather", "shard", params, weights, times=gathers, sync=False),
            Collective("reduce_scatter", "shard", params, self.reduce_dtype, times=syncs),
        ]
        if replicate > 1:
            found.append(Collective("all_reduce", "replicate", params / shard, self.reduce_dtype, times=syncs))
        return found

    def requirements(self) -> Requirements:
        return Requirements(model_plan=self.tp.size > 1)

    def conformance(self) -> Conformance:
        replicate, shard = self.mesh.replicate_size, self.mesh.shard_size
        if self.tp.size > 1:  # 2 data-parallel ranks of T
            return Conformance(ranks=2 * self.tp.size)
        if replicate is None and shard is None:  # strategy=hsdp: 2 replicas of a 2-rank shard group, the same K = 2
            return Conformance(ranks=4, overrides=("strategy.shard_size=2", "batch.micro_size=2"))
        return Conformance()

    def check(self, ctx: RunContext, model: nn.Module) -> str | None:
        self.mesh.groups(ctx.world_size, ctx.local_world_size)  # sizes that do not tile the world raise here
        # Values outside offload's and reduce_dtype's choices already fail at composition (typed schema).
        if self.reduce_dtype == "fp16" and ctx.precision != "fp16":
            # Only precision=fp16 runs the loss scaler; unscaled fp16 gradients underflow to 0 or overflow to inf.
            raise ValueError(
                f"strategy.reduce_dtype=fp16 with precision={ctx.precision} reduces unscaled gradients "
                "in fp16; use strategy.reduce_dtype=fp32 or bf16, or precision=fp16 (loss-scaled)"
            )
        present = sorted({type(m).__name__ for m in model.modules() if m is not model})
        units = unit_classes(model, self.shard_units)
        for line in tied_unit_lines(model, self.shard_units):  # tied parameters stay in one unit
            print(f"launch: fsdp: {line}", flush=True)
        for name in units:
            if name not in present:
                guess = (difflib.get_close_matches(name, present, n=1) or present[:1] or ["<class name>"])[0]
                raise ValueError(
                    f"strategy.shard_units: no module of class '{name}' in {type(model).__name__} "
                    f"(its classes: {', '.join(present)}); e.g. strategy.shard_units=[{guess}]"
                )
        check_moe_blocks(model, self.moe_blocks)
        self.tp.check(ctx.world_size, ctx.local_world_size, model, ctx.seq_len)
        check_held(model, "fsdp")  # tensors the model holds outside its parameters and buffers: filled in setup
        blocks = moe_blocks(model, self.moe_blocks)
        split = units_inside(model, blocks, units)
        if split:
            raise ValueError(
                f"strategy.shard_units=[{', '.join(split)}] makes units inside the mixture-of-experts block "
                f"{', '.join(block_classes(blocks))}, whose experts some ranks skip (their all-gathers and "
                "reduce-scatters would not match); shard the block or a layer around it instead, e.g. "
                f"strategy.shard_units=[{block_classes(blocks)[0]}]"
            )
        for asked, what in (
            (ctx.compile, "trainer.compile=true compiles"),
            (self.activation_checkpointing, "strategy.activation_checkpointing=true checkpoints"),
        ):
            if asked and not units:
                raise ValueError(
                    f"{what} each shard unit, but {type(model).__name__} has none (strategy.shard_units is empty "
                    "and it declares no _no_split_modules); name its layer classes, e.g. strategy.shard_units=[Block]"
                )
        if not units:
            print(
                f"launch: fsdp: {type(model).__name__} declares no _no_split_modules and strategy.shard_units is "
                "unset: the whole model is one unit (parameters, gradients and optimizer state are still sharded "
                "1/G, but every parameter is gathered at once); name its layer classes to gather one at a time, "
                "e.g. strategy.shard_units=[MyBlock]",
                flush=True,
            )
        if not ctx.no_grad:
            return None
        return (
            "fsdp reduces only the gradients that exist: a parameter gets one only in a step where the forwards used "
            "it, and changes only then, as in one process (the ranks' forwards must use the same parameters in a step)"
        )

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.ctx = ctx
        replicate, shard = self.mesh.groups(ctx.world_size, ctx.local_world_size)
        self._counter.world_size = shard  # the reduce-scatters' and all-gathers' ring: one shard group
        # No rank holds the whole model on its device: rank 0 builds it in host memory (the same random draws as
        # DDP's, hence the same weights), every rank builds it on the meta device, shards it there, and then
        # materialises only its own shards, filled from rank 0's tensors one at a time.
        whole = build_model() if ctx.rank == 0 else None
        model = build_model(meta=True)
        held = held_tensors(model)  # a scheduler's noise schedule, a lookup table: neither parameters nor buffers
        units = unit_modules(model, unit_classes(model, self.shard_units))
        mesh, tp_mesh, *_ = device_meshes(ctx.device_type, replicate, shard, self.tp.size)
        # torchtitan's order, one step after another (`strategies.parallelize`): tensor parallel, then activation
        # checkpointing and compile of what it split, then data-parallel sharding around them.
        apply_tp(model, self.tp, tp_mesh)
        # Inside a unit, FSDP2 reduce-scatters only the gradients its rank has: an expert a rank skipped must still
        # get one (zero), or the ranks' reduce-scatters differ in size.
        blocks = moe_blocks(model, self.moe_blocks)
        use_every_parameter(blocks)
        self._same_modules = SameModulesCheck(model, blocks)
        if self.activation_checkpointing:
            apply_ac(units)
        if ctx.compile:
            apply_compile(units)
        if self.sync_batchnorm:  # over every rank (HSDP: every replica's too): the statistics of the global micro-batch
            model = sync_batchnorm(model, ctx.device_type)
        apply_fsdp(
            model,
            units,
            mesh,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=autocast_dtype(ctx.precision),
            reduce_dtype=DTYPES[self.reduce_dtype],
            offload=self.offload == "cpu",
            device_type=ctx.device_type,
        )
        model.to_empty(device="cpu" if self.offload == "cpu" else ctx.device)
        _fill_from_rank0(model, whole)
        fill_held(held, model, whole, ctx.device)  # what to_empty and the state dict never reach: rank 0's values
        del whole
        reduce_scatter, all_gather = _counting_collectives(self._counter)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(reduce_scatter)
                module.set_custom_all_gather(all_gather)
                if replicate > 1:
                    module.set_all_reduce_hook(_counting_all_reduce(self._counter, replicate))
        self.model = model
        self.optimizer = build_optimizer(model)
        if hasattr(self.optimizer, "on_gather"):  # one that gathers whole parameters to update them (optim=muon)
            self.optimizer.on_gather = lambda whole: self._counter.record(whole, "all_gather", sync=False)
        self.ema = ema_of(model, ctx.ema)  # DTensors like the parameters: each rank averages its shard
        # fp16 needs loss scaling; the sharded scaler agrees on inf/NaN across ranks, since each sees only its shard.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scaler = ShardedGradScaler(ctx.device_type, enabled=ctx.precision == "fp16")

    def forward(self, batch: Any) -> torch.Tensor:
        # No autocast: MixedPrecisionPolicy already runs each unit in the parameter dtype.
        with self._same_modules.watch(), self.tp.counted():
            return call_model(self.model, batch)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return self._sync(enabled or self.sync_each_microbatch)

    @contextmanager
    def _sync(self, enabled: bool) -> Iterator[None]:
        # The reduce-scatters are issued during backward, inside this context; restore the default after.
        self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def backward(self, loss: torch.Tensor) -> None:
        fix = "name its class in strategy.moe_blocks (the block around the modules its router skips)"
        self._same_modules.compare(torch.device(self.ctx.device), fix)
        with self.tp.counted():
            self.scaler.scale(loss).backward()

    def step(self, lr: float) -> float:
        # What FSDP itself put in host memory (its parameters' offload flag, from the policy it was given), with the
        # gradients and optimizer state of those parameters: reported apart from what stays on the device.
        on_host = self._offloaded_params()
        norm, held, offloaded = optimizer_step(
            self.model, self.optimizer, self.scaler, self.ctx.grad_clip, lr, lambda p: id(p) in on_host, self.ema
        )
        figures = step_figures(self._counter, held - offloaded, offloaded, scaler_scale(self.scaler))
        self._last_step = figures | self.tp.figures()
        return norm

    def _offloaded_params(self) -> set[int]:
        from torch.distributed.fsdp import FSDPModule

        found = set()
        for module in self.model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group is not None else ():
                if fsdp_param.offload_to_cpu:
                    found.add(id(fsdp_param.sharded_param))
        return found

    def train(self, mode: bool) -> None:
        self.model.train(mode)
        if mode:
            self._counter.take()  # the all-gathers of an evaluation are not the next training step's
            self.tp.figures()  # nor its activations' collectives

    def state_dict(self) -> dict[str, Any]:
        return torch_state_dict(self.model, self.optimizer, self.ema)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_torch_state_dict(self.model, self.optimizer, state, self.ema)

    def averaged(self) -> AbstractContextManager[bool]:
        return averaged(self.ema)

    def metrics(self) -> dict[str, float]:
        return dict(self._last_step)

    def teardown(self) -> None:
        # The sharded parameters hold the device mesh, which holds the process group.
        self.model = self.optimizer = self.scaler = self.ema = None  # type: ignore[assignment]


def _fill_from_rank0(model: nn.Module, whole: nn.Module | None) -> None:
    """Every rank's shards (and buffers) from rank 0's whole model, one tensor at a time (collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole.state_dict() if whole is not None else {}, options=options)
    # Buffers that are not in the state dict (non-persistent: a causal mask, rotary frequencies) are still empty.
    sources = dict(whole.named_buffers()) if whole is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if whole is not None:
                buffer.copy_(sources[name])
            dist.broadcast(buffer, src=0)
