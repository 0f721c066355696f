"""Native DistributedDataParallel: a full replica per rank, one gradient all-reduce per optimizer step (in fp32, or
compressed to bf16/fp16 on the wire by torch's compression hook: strategy.grad_compression)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from strategies.base import ModelFactory, OptimizerFactory, RunContext, call_model
from strategies.batchnorm import sync_batchnorm
from strategies.comm import CommCounter
from strategies.declarations import WIRE_BYTES, Collective, Conformance, Layout, Placement, Requirements, Transients
from strategies.ema import averaged, ema_of
from strategies.moe import SameModulesCheck, check_moe_blocks, moe_blocks, use_every_parameter
from strategies.no_grad import AbsentGradients, count, ddp_unused, grouped
from strategies.state import load_torch_state_dict, torch_state_dict
from strategies.stepping import autocast_dtype, optimizer_step, scaler_scale, step_figures
from strategies.units import compile_units, unit_classes, unit_modules

UNUSED = "Expected to have finished reduction in the prior iteration"
"""The start of torch's error when a parameter got no gradient on a rank and find_unused_parameters was off."""


HOOKS = {
    "none": default_hooks.allreduce_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
"""torch's comm hook for each strategy.grad_compression: the bucket all-reduced as it is (fp32), or cast to 16 bits
for the wire and back (half the bytes, gradients rounded to 16 bits)."""


class _Counting:
    """The comm hook's state: the counter, and the hook that all-reduces. DDP checks hook annotations against the
    real GradBucket/Future classes; string annotations (`from __future__ import annotations`) would fail that
    check, so the hook below has none."""

    def __init__(self, counter: CommCounter, compression: str) -> None:
        self.counter, self.compression = counter, compression


def _counting_hook(state, bucket):  # type: ignore[no-untyped-def]
    buffer = bucket.buffer()
    wire = WIRE_BYTES["fp32" if state.compression == "none" else state.compression]
    state.counter.record(buffer.numel() * wire, "all_reduce")  # what goes on the wire: the compressed bucket
    return HOOKS[state.compression](None, bucket)


class DDP:
    def __init__(  # every option's default is its schema's (launcher/config/schema.py), written there alone
        self,
        *,
        bucket_cap_mb: float,
        sync_batchnorm: bool,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        compile_units: list[str] | None,
        moe_blocks: list[str] | None,
        grad_compression: str,
    ) -> None:
        if grad_compression not in HOOKS:
            raise ValueError(f"strategy.grad_compression={grad_compression}: use one of {', '.join(HOOKS)}")
        self.grad_compression = grad_compression
        self.bucket_cap_mb = bucket_cap_mb
        self.sync_batchnorm = sync_batchnorm
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.compile_units = None if compile_units is None else [str(name) for name in compile_units]
        self.moe_blocks = None if moe_blocks is None else [str(name) for name in moe_blocks]
        self._counter = CommCounter()
        self._last_step: dict[str, float] = {}

    def layout(self) -> Layout:
        replicated = Placement(sharded=False)
        transients = Transients(
            mixed_weight_copies=1.0,  # autocast's casts of the fp32 weights, kept from forward to backward
            model_grads=0.0 if self.gradient_as_bucket_view else 1.0,  # buckets: the gradients, or a copy of them
            full_grads_accumulating=1.0,  # under no_sync gradients accumulate outside the buckets, then are copied
        )
        return Layout(params=replicated, grads=replicated, optimizer=replicated, transients=transients)

    def collectives(
        self, params: float, precision: str, accumulation: int, world_size: int, gpus: int | None, reused: float = 0
    ) -> list[Collective]:
        """One all-reduce of every gradient per optimizer step, whatever K (no_sync before the last micro-step): fp32
        gradients (autocast keeps fp32 parameters under bf16 and fp16), or compressed to 16 bits."""
        wire = "fp32" if self.grad_compression == "none" else self.grad_compression
        return [Collective("all_reduce", "world", params, wire)]

    def requirements(self) -> Requirements:
        return Requirements()

    def conformance(self) -> Conformance:
        if self.grad_compression == "none":
            return Conformance()
        # Gradients rounded on the wire (bf16 the coarser: 8 significant bits; fp16 11). Each element of the synced
        # gradient is rounded twice (compressed, then summed): off by at most 2^-8 relatively, so is the norm of the
        # gradient that step (2^-8 = 3.9e-3: the norm's tolerance), and by 1.6e-3 rms (uniform rounding,
        # 2^-9 x sqrt(2/3)). AdamW's step is scale-free (about lr per weight), so each step's rounding moves every
        # weight by about lr x 1.6e-3 in a random direction, and the loss s steps on by about
        # 1.6e-3 x |g| x sqrt(sum of lr^2 over the steps before) (rms): on the suite's job (fp32, 12 steps, |g| 2 to
        # 4, lr up to 3e-3) 3e-5 at step 8. The loss tolerance, 1e-4, is three times that. Measured there: losses
        # 3.1e-5, validation loss 4.6e-5, gradient norm 7.3e-4 relative, with AVX2's kernels and with none
        # (ATEN_CPU_CAPABILITY=default) alike.
        return Conformance(tolerance=1e-4, norm_tolerance=2**-8, lossy=True)

    def check(self, ctx: RunContext, model: nn.Module) -> str | None:
        check_moe_blocks(model, self.moe_blocks)
        if ctx.compile and self.compile_units == []:
            raise ValueError(
                "trainer.compile=true compiles each unit, but strategy.compile_units is empty; "
                "name the unit classes, e.g. strategy.compile_units=[Block]"
            )
        if not ctx.no_grad:
            return None
        if self.find_unused_parameters:
            how = "finds them at every forward (strategy.find_unused_parameters=true)"
        else:
            how = "leaves them out of its buckets and all-reduces them itself once per step, with a flag each"
        return (
            f"ddp {how}: a parameter gets a gradient only in a step where some rank's forward used it, and changes "
            "only then, as in one process"
        )

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        self.ctx = ctx
        self._counter.world_size = ctx.world_size
        module = build_model().to(ctx.device)
        # Every parameter of a mixture-of-experts block gets a gradient on every rank (zero for an expert this rank
        # routed nothing to), as under FSDP and ZeRO: the same gradients, and no unused parameters to find.
        blocks = moe_blocks(module, self.moe_blocks)
        use_every_parameter(blocks)
        # Parameters the launcher saw get no gradient stay out of DDP's buckets (each bucket waits for all of its
        # gradients) unless DDP searches the graph for them itself; they are synchronised in `step`.
        absent = [] if self.find_unused_parameters else list(ctx.no_grad)
        if absent:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, absent)
        self._absent = AbsentGradients(module, absent, self._counter)
        self._moe = bool(blocks)
        if ctx.compile:
            # Before wrapping: DDP's bucketed all-reduce hooks stay outside the compiled graphs (as under FSDP).
            # Unit by unit where the model has units (the model's _no_split_modules, or strategy.compile_units).
            compile_units(unit_modules(module, unit_classes(module, self.compile_units)) or [module])
        if self.sync_batchnorm:
            module = sync_batchnorm(module, ctx.device_type)
        self.model = DistributedDataParallel(
            module,
            device_ids=[torch.device(ctx.device).index] if ctx.device_type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        self.model.register_comm_hook(_Counting(self._counter, self.grad_compression), _counting_hook)
        self._absent.broadcast()
        # With find_unused_parameters off, a module one rank skips is named once, not a collective that never ends;
        # modules whose parameters are all synchronised apart (`absent`) may be skipped by any rank.
        apart = [m for m in module.modules() if _params_within(m, self._absent.params)]
        self._same_modules = SameModulesCheck(module, [module] if self.find_unused_parameters else blocks + apart)
        self.optimizer = build_optimizer(module)  # the unwrapped module: the checkpoint's names
        self.ema = ema_of(module, ctx.ema)
        self.dtype = autocast_dtype(ctx.precision)
        # fp16 needs loss scaling; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(ctx.device_type, enabled=ctx.precision == "fp16")

    def forward(self, batch: Any) -> torch.Tensor:
        autocast = torch.autocast(self.ctx.device_type, dtype=self.dtype, enabled=self.dtype is not None)
        try:
            with autocast, self._same_modules.watch():
                return call_model(self.model, batch)
        except RuntimeError as e:
            if UNUSED not in str(e):
                raise
            raise RuntimeError(self._unused_line(str(e))) from e

    def _unused_line(self, message: str) -> str:
        """DDP's error after a step in which some parameters got no gradient, naming them (by the indices it lists)."""
        found = ddp_unused(message, self.model.module, self._absent.names)
        which = (
            f"{count(found[1])} got no gradient on rank {found[0]} in the previous step: {grouped(found[1])}"
            if found and found[1]
            else "some parameters got no gradient on a rank in the previous step"
        )
        guess = " (experts no token was routed to?)" if self._moe else ""
        return f"{which}{guess}; DDP waits for every gradient unless told: set strategy.find_unused_parameters=true"

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return nullcontext() if enabled else self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self._same_modules.compare(torch.device(self.ctx.device), "set strategy.find_unused_parameters=true")
        self.scaler.scale(loss).backward()

    def step(self, lr: float) -> float:
        self._absent.reduce(self.ctx.world_size)
        norm, held, _ = optimizer_step(self.model, self.optimizer, self.scaler, self.ctx.grad_clip, lr, ema=self.ema)
        self._last_step = step_figures(self._counter, held, loss_scale=scaler_scale(self.scaler))
        return norm

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def state_dict(self) -> dict[str, Any]:
        return torch_state_dict(self.model, self.optimizer, self.ema)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_torch_state_dict(self.model, self.optimizer, state, self.ema)

    def averaged(self) -> AbstractContextManager[bool]:
        return averaged(self.ema)

    def metrics(self) -> dict[str, float]:
        return dict(self._last_step)

    def teardown(self) -> None:
        self.model = self.optimizer = self.scaler = self.ema = None  # type: ignore[assignment]


def _params_within(module: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether every trainable parameter of the module's own is one of `params` (and it has one)."""
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    ids = {id(p) for p in params}
    return bool(own) and all(id(p) in ids for p in own)
