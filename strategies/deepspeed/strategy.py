"""DeepSpeed ZeRO stages 1-3, with optimizer/parameter offload to CPU or NVMe: one strategy, presets in conf/strategy/.

The DeepSpeed config comes from `config.build_ds_config`; what reaches into ZeRO's internals is in `zero`.
`import deepspeed` happens only inside methods, so DDP and FSDP runs and `launch --help` never pay for it.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from strategies.base import ModelFactory, OptimizerFactory, RunContext, call_model
from strategies.comm import CommCounter
from strategies.declarations import WIRE_BYTES, Collective, Conformance, Layout, Placement, Requirements, Transients
from strategies.deepspeed import zero
from strategies.deepspeed.config import BUCKET_SHARE, OFFLOAD_DEVICES, build_ds_config, check_recipe
from strategies.deepspeed.ops import async_io_problem
from strategies.ema import EMA, averaged
from strategies.moe import SameModulesCheck, block_classes, check_moe_blocks, moe_blocks, use_every_parameter
from strategies.no_grad import without_decay
from strategies.stepping import set_lr, step_figures

ADAM_OPTIMIZERS = {"torch.optim.AdamW": True, "torch.optim.Adam": False}
"""Optimizers DeepSpeed's CPU Adam can stand in for under optimizer offload: class -> adamw_mode."""

# Bytes per parameter that NVMe offload writes: fp32 master + two Adam moments, fp32 parameters.
NVME_OPTIMIZER_BYTES, NVME_PARAM_BYTES = 12, 4
NVME_MARGIN = 1.2
"""DeepSpeed swaps aligned buffers and keeps spares: ask for a fifth more than the state itself."""


class DeepSpeed:
    def __init__(  # every option's default is its schema's (launcher/config/schema.py), written there alone
        self,
        *,
        stage: int,
        offload_optimizer: str,
        offload_params: str,
        nvme_path: str | None,
        sync_each_microbatch: bool,
        sync_batchnorm: bool,
        ds_config: dict[str, Any] | None,
        optimizer: str,
        moe_blocks: list[str] | None,
    ) -> None:
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.nvme_path = nvme_path
        self.sync_each_microbatch = sync_each_microbatch
        self.sync_batchnorm = sync_batchnorm
        self.ds_config: dict[str, Any] = dict(ds_config or {})
        self.optimizer_target = optimizer
        self.moe_blocks = None if moe_blocks is None else [str(name) for name in moe_blocks]
        self._counter = CommCounter()
        self._accumulating: ExitStack | None = None
        self._swap_dir: str | None = None
        self._last_step: dict[str, float] = {}

    # ------------------------------------------------------------------ plan and checks (parent)

    def layout(self) -> Layout:
        """What a rank holds when the optimizer steps.

        Gradients are sharded at every stage: DeepSpeed's ZeRO-1 also reduces them into the rank's
        partition and frees the full ones before the step. ZeRO-1 and ZeRO-2 differ before it: ZeRO-1
        holds full gradients until the end of the last backward, ZeRO-2 reduces them bucket by bucket
        during it. Every stage keeps an fp32 master partition, even in fp32 training.
        """

        def place(sharded: bool, where: str) -> Placement:
            return Placement(sharded=sharded, where="device" if where == "none" else where)

        grads_where = "cpu" if self.offload_optimizer != "none" else "none"
        sharded_params = self.stage >= 3
        transients = Transients(
            model_grads=2 / BUCKET_SHARE,  # two reduce buckets of 1/8 of the model (config.buffers)
            full_grads=1.0 if self.stage == 1 else 0.0,  # ZeRO-1 reduces at the end of the backward
            full_grads_accumulating=0.0 if self.sync_each_microbatch else 1.0,  # reduced once, at the last micro-step
            unit_weights=2.0 if sharded_params else 0.0,  # ZeRO-3: the unit computing and the one prefetched
            unit_grads=2.0 if sharded_params else 0.0,
        )
        return Layout(
            params=place(sharded_params, self.offload_params),
            grads=place(True, grads_where),  # reduced into host buffers for the CPU Adam when offloaded
            optimizer=place(True, self.offload_optimizer),
            master_weights=True,
            low_precision_weights=True,
            transients=transients,
            flat=True,
        )

    def collectives(
        self, params: float, precision: str, accumulation: int, world_size: int, gpus: int | None, reused: float = 0
    ) -> list[Collective]:
        """Gradients reduce-scattered into each rank's partition once per step (every micro-step under
        sync_each_microbatch), in the parameters' dtype unless ds_config's communication_data_type says otherwise;
        the updated partitions all-gathered after the step (ZeRO-1/2); or, under ZeRO-3, each module's own
        parameters gathered before its forward and again before its backward, in every micro-step: a parameter that
        several modules hold (`reused`: the GPT's embedding, which its head holds too) once per module.

        DeepSpeed may keep a parameter gathered from one use to the next where the trace it recorded lets it (its
        `stage3_max_reuse_distance`); it records that trace on the first forward and backward it sees, and a forward
        without a backward before it (the evaluation's check) moves the recording to the boundary micro-step, whose
        trace keeps nothing: the suite's runs gather per use, as declared."""
        weights = "fp32" if precision == "fp32" else precision
        chosen = self.ds_config.get("communication_data_type")
        wire = chosen if chosen in WIRE_BYTES else weights
        syncs = accumulation if self.sync_each_microbatch else 1
        gathers, gathered = (2 * accumulation, params + reused) if self.stage >= 3 else (1, params)
        return [
            Collective("reduce_scatter", "world", params, wire, times=syncs),
            Collective("all_gather", "world", gathered, weights, times=gathers, sync=False),
        ]

    def requirements(self) -> Requirements:
        offloads = (self.offload_optimizer, self.offload_params)
        ops = ("shm_comm",) + (("cpu_adam",) if self.offload_optimizer != "none" else ())
        return Requirements(
            ops=ops + (("async_io",) if "nvme" in offloads else ()),
            nvme_folder="nvme" in offloads,
            # DeepSpeed and its Muon (every ZeRO optimizer's constructor imports it, and torch's inductor with it).
            imports=("strategies.deepspeed.imported",),
            set_up_again=False,
        )

    def conformance(self) -> Conformance:
        # Torch's tolerance, offloaded too: DeepSpeed's CPU Adam kernel rounds the same update differently, within it.
        return Conformance()

    def check(self, ctx: RunContext, model: nn.Module) -> str | None:
        if ctx.compile:
            raise ValueError(
                "trainer.compile=true is not supported by DeepSpeed strategies here; "
                "use trainer.compile=false, or strategy=fsdp or ddp"
            )
        if self.sync_batchnorm:
            raise ValueError(
                "strategy.sync_batchnorm=true is not supported by DeepSpeed strategies here; use strategy=ddp, fsdp "
                "or hsdp for synchronised BatchNorm, or strategy.sync_batchnorm=false (each rank's own statistics)"
            )
        for name, value in (("offload_optimizer", self.offload_optimizer), ("offload_params", self.offload_params)):
            if value not in OFFLOAD_DEVICES:
                raise ValueError(f"strategy.{name}={value} is invalid; use one of {', '.join(OFFLOAD_DEVICES)}")
        if self.offload_params != "none" and self.stage < 3:
            raise ValueError(
                f"strategy.offload_params={self.offload_params} needs strategy.stage=3 (got {self.stage}): "
                "only ZeRO-3 partitions parameters"
            )
        check_recipe(ctx, self.stage, self.offload_params, self.ds_config, self.optimizer_target)
        if self.offload_optimizer == "nvme" and self.stage < 3:
            raise ValueError(
                f"strategy.offload_optimizer=nvme needs strategy.stage=3 (got {self.stage}): ZeRO-1/2 keep "
                "offloaded optimizer state in host memory; use strategy.offload_optimizer=cpu or strategy.stage=3"
            )
        if self.offload_optimizer != "none" and self.optimizer_target not in ADAM_OPTIMIZERS:
            raise ValueError(
                f"strategy.offload_optimizer={self.offload_optimizer} runs DeepSpeed's CPU Adam, which cannot stand in "
                f"for {self.optimizer_target}; use optim=adamw or strategy.offload_optimizer=none"
            )
        if ctx.precision == "fp16" and ctx.device_type == "cpu" and not cpu_fp16():
            raise ValueError(
                "precision=fp16 under DeepSpeed on CPU needs a processor with float16 support, which this one lacks "
                "(DeepSpeed's CPU accelerator refuses it); use precision=bf16 or fp32, or strategy=ddp or fsdp"
            )
        check_moe_blocks(model, self.moe_blocks)
        blocks = moe_blocks(model, self.moe_blocks)
        if blocks and self.sync_each_microbatch and self.stage >= 2:
            # ZeRO-2/3 reduce each micro-step's gradients in buckets filled in the order the gradients are ready, which
            # differs between ranks whose routers chose different experts: the ranks' reduces no longer match.
            raise ValueError(
                f"strategy.sync_each_microbatch=true under ZeRO-{self.stage} reduces each micro-step's gradients in "
                "the order they are ready, which differs between ranks that routed to different experts of the "
                f"mixture-of-experts block {', '.join(block_classes(blocks))}; use "
                "strategy.sync_each_microbatch=false (one reduce per step, in the parameters' order), or "
                "strategy=zero1 or fsdp"
            )
        build_ds_config(ctx, self.stage, self.offload_optimizer, self.offload_params, self.nvme_path, self.ds_config)
        if "nvme" in (self.offload_optimizer, self.offload_params):
            self._check_nvme(ctx, sum(p.numel() for p in model.parameters()))
        if not ctx.no_grad:
            return None
        return (
            f"ZeRO-{self.stage} gives every parameter a gradient, zero where it got none: these are stepped in a group "
            "without weight decay, so while they get none they stay as they are; one that gets a gradient in some "
            "steps and none in others moves in the others too (its optimizer moments are no longer zero) and is never "
            "decayed, unlike under ddp and fsdp"
        )

    def _check_nvme(self, ctx: RunContext, params: int) -> None:
        path = self.nvme_path
        if not path:
            raise ValueError(
                "strategy.nvme_path is unset but NVMe offload needs it; "
                "set strategy.nvme_path=<folder on a local NVMe disk>"
            )
        if not os.path.isdir(path):
            raise ValueError(
                f"strategy.nvme_path={path} does not exist or is not a folder; create it or point it at one"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"strategy.nvme_path={path} is not writable by this user; fix its permissions or choose another folder"
            )
        per_param = (NVME_OPTIMIZER_BYTES if self.offload_optimizer == "nvme" else 0) + (
            NVME_PARAM_BYTES if self.offload_params == "nvme" else 0
        )
        # Every rank of this node swaps its 1/G share here; with one node that is the whole model.
        needed = int(NVME_MARGIN * per_param * params)
        free = shutil.disk_usage(path).free
        if free < needed:
            raise ValueError(
                f"strategy.nvme_path={path} has {free / 2**30:.1f} GiB free but NVMe offload needs about "
                f"{needed / 2**30:.1f} GiB; free space there or choose a larger disk"
            )
        problem = async_io_problem(ctx.device_type)
        if problem:
            raise ValueError(problem)

    # ------------------------------------------------------------------ training (workers)

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        import strategies.deepspeed.imported  # noqa: F401, I001  # before any `import deepspeed`
        import deepspeed

        zero.check_deepspeed()  # the private names the strategy relies on, in one line where a release changed one
        # DeepSpeed calls torch collectives that torch has deprecated: nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        self.ctx = ctx
        self._counter.world_size = ctx.world_size
        # Reuses the process group the worker created (gloo on CPU, nccl on CUDA).
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device_type == "cuda" else "gloo")
        if "nvme" in (self.offload_optimizer, self.offload_params):
            # A folder of this rank's own, removed in teardown: swap files never pile up across runs.
            self._swap_dir = tempfile.mkdtemp(prefix=f"launch-swap-rank{ctx.rank}-", dir=self.nvme_path)
        model = build_model()
        # Every parameter of an MoE block gets a gradient (zero where this rank routed no token to it), so every rank
        # fills the same reduce buckets; ZeRO-3 gathers each block whole, so no rank gathers an expert others skip.
        blocks = moe_blocks(model, self.moe_blocks)
        use_every_parameter(blocks)
        self._same_modules = SameModulesCheck(model, blocks)
        # With routed experts, every step reduces once, at its end, in the parameters' order (also at K = 1):
        # DeepSpeed's own path fills its buckets in the order gradients are ready, which differs between ranks that
        # routed apart.
        self._coalesce_always = bool(blocks)
        if blocks and self.stage == 3:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list({type(block) for block in blocks}))
        params = sum(p.numel() for p in model.parameters())
        largest = max((p.numel() for p in model.parameters()), default=0)
        config = build_ds_config(
            ctx,
            self.stage,
            self.offload_optimizer,
            self.offload_params,
            self._swap_dir,
            self.ds_config,
            params,
            largest,
        )
        if self.stage == 3:
            # Partitioned after it is built, not while: built inside zero.Init's context, a model is partitioned
            # layer by layer as it is constructed, so what its own code does next (a transformers model's weight
            # initialisation, `from_pretrained` loading weights) writes into empty partitions. Converting the built
            # model broadcasts rank 0's values and keeps each rank's partition: the same weights as DDP's, whatever
            # the model. The whole model is in host memory meanwhile, once per rank.
            deepspeed.zero.Init(module=model, config_dict_or_path=config)
        optimizer = self._optimizer(model, build_optimizer)
        groups = list(optimizer.param_groups)  # DeepSpeed replaces their parameters with its partitions
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        zero.regroup_adagrad(self.engine, self.stage, [{k: v for k, v in g.items() if k != "params"} for g in groups])
        self.ema = EMA(zero.ema_live(self.engine, self.stage), ctx.ema) if ctx.ema else None

    def _optimizer(self, model: nn.Module, build_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = build_optimizer(model)
        if self.offload_optimizer != "none":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            # The offloaded step runs on the host in DeepSpeed's C++ Adam, with optim's values, in the same groups.
            own = set(optimizer.defaults) - {"lr", "betas", "eps", "weight_decay"}  # torch's keys CPU Adam lacks
            groups = [{k: v for k, v in g.items() if k not in own} for g in optimizer.param_groups]
            keywords = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=ADAM_OPTIMIZERS[self.optimizer_target], **keywords)
        # Parameters that got no gradient on the launcher's first micro-batch get a zero one in DeepSpeed's flat
        # buffers: without weight decay, zero moments leave them as they are (`strategies.no_grad`).
        without_decay(optimizer, model, self.ctx.no_grad)
        return optimizer

    def forward(self, batch: Any) -> torch.Tensor:
        with self._same_modules.watch():
            return call_model(self.engine, batch)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return self._micro_step(enabled)

    @contextmanager
    def _micro_step(self, last: bool) -> Iterator[None]:
        # DeepSpeed's own path reduces in buckets during the backward (ZeRO-1 only on the boundary
        # micro-step, ZeRO-2/3 on every one): used for the last micro-step when nothing accumulated
        # before it (K = 1) and the model routes no experts, and for every micro-step with sync_each_microbatch.
        self.engine.set_gradient_accumulation_boundary(last)
        coalesce = not last or self._coalesce_always
        if coalesce and not self.sync_each_microbatch and self._accumulating is None:
            # Otherwise one coalescing block spans the micro-steps of an optimizer step: gradients
            # accumulate locally and are reduced once, when the last micro-step leaves the block.
            self._accumulating = ExitStack()
            self._accumulating.enter_context(self.engine.coalesce_grad_reduction())
        with zero.counting_collectives(self._counter):
            yield
            if last and self._accumulating is not None:
                self._accumulating.close()
                self._accumulating = None

    def backward(self, loss: torch.Tensor) -> None:
        fix = "name its class in strategy.moe_blocks (the block around the modules its router skips)"
        self._same_modules.compare(torch.device(self.ctx.device), fix)
        # The runner already divided the loss by the accumulation steps.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float) -> float:
        set_lr(self.engine.optimizer, lr)
        # The runner calls step once per optimizer step: always DeepSpeed's boundary (a coalescing
        # block restores the flag it saw when it opened, on the first micro-step).
        self.engine.set_gradient_accumulation_boundary(True)
        grads = zero.gradient_bytes(self.engine, self.stage)
        # A non-finite global norm is not committed by DeepSpeed itself: ZeRO-1/2/3 take it for an overflow (fp32;
        # bf16 with its default bf16.check_grad_overflow; fp16's loss scaler), zero the gradients, leave parameters
        # and optimizer state as they were, and report the norm as inf.
        with zero.counting_collectives(self._counter, gathers_only=True):  # ZeRO-1/2 gather the updated parameters
            self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if self.ema is not None and norm is not None and math.isfinite(float(norm)):  # the step was applied
            self.ema.update()
        held = zero.state_bytes(self.engine, self.stage, grads)
        # DeepSpeed's dynamic loss scaler (precision=fp16), as DDP and FSDP report theirs: halved on each overflow.
        scale = float(self.engine.optimizer.loss_scale) if self.ctx.precision == "fp16" else None
        self._last_step = step_figures(self._counter, *held, loss_scale=scale)
        return float(norm) if norm is not None else float("nan")

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    def metrics(self) -> dict[str, float]:
        return dict(self._last_step)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 weights and optimizer state, keyed like torch's full state dict: strategy-neutral."""
        return zero.export_state(self.engine, self.stage, self.offload_optimizer, self.ema)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        zero.import_state(self.engine, self.stage, self.offload_optimizer, self.offload_params, state, self.ema)

    @contextmanager
    def averaged(self) -> Iterator[bool]:
        # ZeRO-3 keeps parameters it gathered for the step while it expects them again: released first, every
        # forward inside gathers the partitions that hold the average, and after it those that hold the weights.
        release = self.engine.empty_partition_cache if self.stage == 3 else lambda: None
        release()
        with averaged(self.ema) as swapped:
            yield swapped
            release()

    def teardown(self) -> None:
        self._accumulating = None  # after a failed micro-step: never flush into ranks that may be gone
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
        self.engine = self.ema = None  # type: ignore[assignment]
        if self._swap_dir is not None:
            import gc

            gc.collect()  # the swappers hold open files in the folder until collected
            shutil.rmtree(self._swap_dir, ignore_errors=True)
            self._swap_dir = None


def cpu_fp16() -> bool:
    """DeepSpeed's own test on CPU (`CPU_Accelerator.is_fp16_supported`): oneDNN's float16 kernels."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
