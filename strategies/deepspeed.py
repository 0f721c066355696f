"""DeepSpeed ZeRO stages 1-3, with optimizer/parameter offload to CPU or NVMe: one strategy, presets in conf/strategy/.

The DeepSpeed config is generated from the run's plain values (`build_ds_config`), never written
twice; `ds_config` adds keys the launcher does not derive. `import deepspeed` happens only inside
methods, so DDP and FSDP runs and `launch --help` never pay for it.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from enum import Enum
from typing import Any

import torch
from torch import nn

from strategies.base import Layout, ModelFactory, OptimizerFactory, Placement, RunContext, call_model, set_lr
from strategies.comm import CommCounter

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ADAM_OPTIMIZERS = {"torch.optim.AdamW": True, "torch.optim.Adam": False}
"""Optimizers DeepSpeed's CPU Adam can stand in for under optimizer offload: class -> adamw_mode."""

# Keys the launcher derives, and the setting they come from. A `ds_config` entry at one of these
# paths with a different value is an error: a silently overridden accumulation setting is the most
# reported pain with other launchers. Keys in OWNED may not appear in `ds_config` at all.
DERIVED_FROM = {
    "train_batch_size": "batch.global_size",
    "train_micro_batch_size_per_gpu": "batch.micro_size",
    "gradient_accumulation_steps": "batch.global_size / (batch.micro_size x world size)",
    "gradient_clipping": "trainer.grad_clip",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "optimizer": "optim",
    "scheduler": "trainer.schedule",
    "zero_optimization.stage": "strategy.stage",
    "zero_optimization.offload_optimizer.device": "strategy.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "strategy.nvme_path",
    "zero_optimization.offload_param.device": "strategy.offload_params",
    "zero_optimization.offload_param.nvme_path": "strategy.nvme_path",
}
OWNED = ("optimizer", "scheduler", "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path")

# Bytes per parameter that NVMe offload writes: fp32 master + two Adam moments, fp32 parameters.
NVME_OPTIMIZER_BYTES, NVME_PARAM_BYTES = 12, 4
NVME_MARGIN = 1.2
"""DeepSpeed swaps aligned buffers and keeps spares: ask for a fifth more than the state itself."""

# DeepSpeed's reduction entry points (called as `deepspeed.comm.<name>` by the ZeRO optimizers).
REDUCTIONS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor")


def _plain(value: Any) -> Any:
    """Nested mappings and sequences (OmegaConf's too: Hydra passes them as they are) as dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def _value(v: Any) -> Any:
    """Enum members (a composed config) and their names (a frozen one) read the same."""
    return v.value if isinstance(v, Enum) else v


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


_MISSING = object()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def build_ds_config(
    ctx: RunContext,
    stage: int,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    swap_path: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a run: derived from the run's values, plus the user's extra keys.

    Raises ValueError (one line) when an extra key contradicts a derived value.
    """
    pin = ctx.device_type == "cuda"  # pinned host buffers speed up device copies; there is no device on CPU

    def offload(device: str) -> dict[str, Any]:
        section: dict[str, Any] = {"device": device, "pin_memory": pin}
        if device == "nvme":
            section["nvme_path"] = swap_path
        return section

    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # Parameters under DeepSpeed's persistence threshold stay gathered on every rank; its default
        # (1e5 elements) keeps all of a small model whole. 0 keeps the layout's rule: every parameter
        # sharded. Raise it in strategy.ds_config to trade memory for fewer small all-gathers.
        zero["stage3_param_persistence_threshold"] = 0
    if offload_optimizer != "none":
        zero["offload_optimizer"] = offload(offload_optimizer)
    if offload_params != "none":
        zero["offload_param"] = offload(offload_params)
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ctx.micro_size,
        "gradient_accumulation_steps": ctx.accumulation,
        "train_batch_size": ctx.micro_size * ctx.accumulation * ctx.world_size,
        # Always written: DeepSpeed clips at 1.0 when the key is absent; 0 disables.
        "gradient_clipping": ctx.grad_clip,
        "bf16": {"enabled": ctx.precision == "bf16"},
        "fp16": {"enabled": ctx.precision == "fp16"},
        "zero_optimization": zero,
        # The client optimizer comes from optim (SGD included): DeepSpeed only tests its own.
        "zero_allow_untested_optimizer": True,
    }
    extra = extra or {}
    for path, source in DERIVED_FROM.items():
        given, ours = _get(extra, path), _get(derived, path)
        if given is _MISSING:
            continue
        if path in OWNED:  # the client optimizer, our LR schedule, each rank's own swap folder
            raise ValueError(f"strategy.ds_config.{path}={given!r} conflicts with the launcher, which sets it "
                             f"from {source}; remove it from strategy.ds_config")
        if given != ours:
            raise ValueError(f"strategy.ds_config.{path}={given!r} conflicts with {path}={ours!r}, which the launcher "
                             f"derives from {source}; remove it from strategy.ds_config")
    return _merge(derived, extra)


class DeepSpeed:
    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: Any = "none",
        offload_params: Any = "none",
        nvme_path: str | None = None,
        sync_each_microbatch: bool = False,
        ds_config: dict[str, Any] | None = None,
        optimizer: str = "torch.optim.AdamW",
    ) -> None:
        self.stage = stage
        self.offload_optimizer = str(_value(offload_optimizer))
        self.offload_params = str(_value(offload_params))
        self.nvme_path = nvme_path
        self.sync_each_microbatch = sync_each_microbatch
        self.ds_config: dict[str, Any] = _plain(ds_config or {})
        self.optimizer_target = optimizer
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
        return Layout(
            params=place(self.stage >= 3, self.offload_params),
            grads=place(True, grads_where),  # reduced into host buffers for the CPU Adam when offloaded
            optimizer=place(True, self.offload_optimizer),
            master_weights=True,
        )

    def check(self, ctx: RunContext, model_config: dict[str, Any]) -> None:
        if ctx.compile:
            raise ValueError("trainer.compile=true is not supported by DeepSpeed strategies here; use strategy=fsdp or ddp")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"strategy.stage={self.stage} is not a ZeRO stage; use 1, 2 or 3")
        if getattr(ctx, "compile", False):  # RunContext.compile: trainer.compile
            raise ValueError("trainer.compile=true is not supported by the DeepSpeed strategies yet; "
                             "use trainer.compile=false, or strategy=ddp or fsdp")
        for name, value in (("offload_optimizer", self.offload_optimizer), ("offload_params", self.offload_params)):
            if value not in OFFLOAD_DEVICES:
                raise ValueError(f"strategy.{name}={value} is invalid; use one of {', '.join(OFFLOAD_DEVICES)}")
        if self.offload_params != "none" and self.stage < 3:
            raise ValueError(
                f"strategy.offload_params={self.offload_params} needs strategy.stage=3 (got {self.stage}): "
                "only ZeRO-3 partitions parameters"
            )
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
        build_ds_config(ctx, self.stage, self.offload_optimizer, self.offload_params, self.nvme_path, self.ds_config)
        if "nvme" in (self.offload_optimizer, self.offload_params):
            self._check_nvme(ctx, model_config)

    def _check_nvme(self, ctx: RunContext, model_config: dict[str, Any]) -> None:
        path = self.nvme_path
        if not path:
            raise ValueError("strategy.nvme_path is unset but NVMe offload needs it; set strategy.nvme_path=<folder on a local NVMe disk>")
        if not os.path.isdir(path):
            raise ValueError(f"strategy.nvme_path={path} does not exist or is not a folder; create it or point it at one")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"strategy.nvme_path={path} is not writable by this user; fix its permissions or choose another folder")
        per_param = (NVME_OPTIMIZER_BYTES if self.offload_optimizer == "nvme" else 0) + (
            NVME_PARAM_BYTES if self.offload_params == "nvme" else 0
        )
        # Every rank of this node swaps its 1/G share here; with one node that is the whole model.
        needed = int(NVME_MARGIN * per_param * _count_parameters(model_config))
        free = shutil.disk_usage(path).free
        if free < needed:
            raise ValueError(
                f"strategy.nvme_path={path} has {free / 2**30:.1f} GiB free but NVMe offload needs about "
                f"{needed / 2**30:.1f} GiB; free space there or choose a larger disk"
            )
        problem = _async_io_problem(ctx.device_type)
        if problem:
            raise ValueError(problem)

    # ------------------------------------------------------------------ training (workers)

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        import deepspeed

        # DeepSpeed calls torch collectives that torch has deprecated: nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        self.ctx = ctx
        # Reuses the process group the worker created (gloo on CPU, nccl on CUDA).
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device_type == "cuda" else "gloo")
        if "nvme" in (self.offload_optimizer, self.offload_params):
            # A folder of this rank's own, removed in teardown: swap files never pile up across runs.
            self._swap_dir = tempfile.mkdtemp(prefix=f"launch-swap-rank{ctx.rank}-", dir=self.nvme_path)
        config = build_ds_config(
            ctx, self.stage, self.offload_optimizer, self.offload_params, self._swap_dir, self.ds_config
        )
        if self.stage == 3:
            # Each layer is partitioned as soon as it is built, so a model larger than one device can
            # be built at all; built outside, NVMe offload would also swap fp32 weights as bf16.
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = build_model()
        else:
            model = build_model()
        optimizer = self._optimizer(model, build_optimizer)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def _optimizer(self, model: nn.Module, build_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        if self.offload_optimizer == "none":
            return build_optimizer(model.parameters())
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # The offloaded step runs on the host in DeepSpeed's C++ Adam, with optim's values.
        assert isinstance(build_optimizer, functools.partial), "optim must be a partial (hydra _partial_)"
        keywords = {k: v for k, v in build_optimizer.keywords.items() if k in ("lr", "betas", "eps", "weight_decay")}
        return DeepSpeedCPUAdam(model.parameters(), adamw_mode=ADAM_OPTIMIZERS[self.optimizer_target], **keywords)

    def forward(self, batch: Any) -> torch.Tensor:
        return call_model(self.engine, batch)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return self._micro_step(enabled)

    @contextmanager
    def _micro_step(self, last: bool) -> Iterator[None]:
        # DeepSpeed's own path reduces in buckets during the backward (ZeRO-1 only on the boundary
        # micro-step, ZeRO-2/3 on every one): used for the last micro-step when nothing accumulated
        # before it (K = 1), and for every micro-step with sync_each_microbatch.
        self.engine.set_gradient_accumulation_boundary(last)
        if not last and not self.sync_each_microbatch and self._accumulating is None:
            # Otherwise one coalescing block spans the micro-steps of an optimizer step: gradients
            # accumulate locally and are reduced once, when the last micro-step leaves the block.
            self._accumulating = ExitStack()
            self._accumulating.enter_context(self.engine.coalesce_grad_reduction())
        with _counting_reductions(self._counter):
            yield
            if last and self._accumulating is not None:
                self._accumulating.close()
                self._accumulating = None

    def backward(self, loss: torch.Tensor) -> None:
        # The runner already divided the loss by the accumulation steps.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float) -> float:
        set_lr(self.engine.optimizer, lr)
        # The runner calls step once per optimizer step: always DeepSpeed's boundary (a coalescing
        # block restores the flag it saw when it opened, on the first micro-step).
        self.engine.set_gradient_accumulation_boundary(True)
        grad_bytes = self._gradient_bytes()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self._last_step = {**self._state_bytes(grad_bytes), **self._counter.take()}
        return float(norm) if norm is not None else float("nan")

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    # ------------------------------------------------------------------ figures

    def _gradient_bytes(self) -> int:
        """This rank's reduced gradients as the optimizer is about to step (its 1/G partition)."""
        opt = self.engine.optimizer
        if self.offload_optimizer != "none":
            return 0  # reduced straight into host buffers for the CPU Adam
        left = sum(_nbytes(p.grad) for p in self.engine.module.parameters() if p.grad is not None)
        if self.stage == 3:
            return left + _nbytes(opt.grad_partitions_flat_buffer)
        return left + sum(_nbytes(t) for ts in opt.averaged_gradients.values() for t in ts if t is not None)

    def _state_bytes(self, grad_bytes: int) -> dict[str, float]:
        """Model state this rank holds on its device, and (estimated from partition sizes) what it offloaded."""
        opt, params = self.engine.optimizer, list(self.engine.module.parameters())
        gathered = sum(_nbytes(p.data) for p in params)  # stage 3: only parameters currently gathered
        if self.stage == 3:
            partition = sum(p.ds_tensor.ds_numel for p in params)
            shards = sum(p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in params)
            on_device = (0 if self.offload_params != "none" else shards) + gathered
            master = opt.fp32_partitioned_groups_flat
        else:
            partition = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
            shards, on_device = 0, gathered
            master = opt.single_partition_of_fp32_groups
        offloaded = shards if self.offload_params != "none" else 0
        if self.offload_optimizer == "none":
            moments = _tensors_bytes(opt.optimizer.state)
            on_device += grad_bytes + sum(_nbytes(t) for t in master) + moments
        else:
            offloaded += partition * (4 + 4 + 8)  # fp32 gradients, master weights, two Adam moments
        return {"model_state_bytes": float(on_device), "offloaded_state_bytes": float(offloaded)}

    def metrics(self) -> dict[str, float]:
        return dict(self._last_step)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 weights and optimizer state, keyed like torch's full state dict: strategy-neutral."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._create_optimizer_state()  # a template for loading holds the moments too
        module, inner = self.engine.module, self.engine.optimizer.optimizer
        names = {id(p): n for n, p in module.named_parameters()}  # a tied parameter under its first name
        keys = sorted({k for s in inner.state.values() for k in s if k != "step"})
        step = next((s["step"] for s in inner.state.values() if "step" in s), None)
        full = {id(p): safe_get_full_fp32_param(p).cpu() for p in module.parameters()}  # collective under ZeRO-3
        model = {n: full[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
        model |= {n: b.detach().cpu() for n, b in module.named_buffers()}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for p in module.parameters():
            if keys:
                state[names[id(p)]] = {k: safe_get_full_optimizer_state(p, k).cpu() for k in keys}
                if step is not None:
                    state[names[id(p)]]["step"] = torch.tensor(float(step))
        zero = self.engine.optimizer
        owners = zero.fp16_groups if self.stage == 3 else zero.bit16_groups  # each group's module parameters
        groups = []
        for group, members in zip(zero.param_groups, owners):
            ids = {id(p) for p in members}
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [n for n, p in module.named_parameters() if id(p) in ids]})
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, from this or any other strategy and world size."""
        from contextlib import nullcontext

        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        self._create_optimizer_state()
        module, zero = self.engine.module, self.engine.optimizer
        weights, moments = state["model"], state["optim"]["state"]
        params = list(module.named_parameters())
        # ZeRO-3: every rank writes the full values into gathered parameters, then they are re-partitioned.
        gathered = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0) if self.stage == 3 else nullcontext()
        with gathered, torch.no_grad():
            for name, p in params:
                p.copy_(weights[name])  # the working copy (rounded, under bf16/fp16)
        if self.offload_params != "nvme":  # NVMe-offloaded working copies are not in host memory to copy from
            zero.refresh_fp32_params()
        for name, p in params:
            safe_set_full_fp32_param(p, weights[name].to(torch.float32))  # the exact fp32 master
            for key, value in moments.get(name, {}).items():
                if key != "step":
                    safe_set_full_optimizer_state(p, value, key)
        step = next((s["step"] for s in moments.values() if "step" in s), None)
        if step is not None:
            _set_step(zero.optimizer, int(step))

    def _create_optimizer_state(self) -> None:
        """Create the optimizer's state before its first step (zero moments at step 0: a fresh start).

        DeepSpeed, like torch, creates it lazily; a checkpoint template and a load need it now. One
        zero-gradient step at learning rate 0 creates it and changes no weight.
        """
        zero = self.engine.optimizer
        inner = zero.optimizer
        # Each fp32 master partition and the index of its param group (ZeRO-3 puts a sub-group's
        # partition into its group only while stepping it).
        if self.stage == 3:
            masters = [(p, zero.sub_group_to_group_id[i]) for i, p in enumerate(zero.fp32_partitioned_groups_flat)]
        else:
            masters = [(p, i) for i, p in enumerate(zero.single_partition_of_fp32_groups)]
        if all(inner.state.get(p) for p, _ in masters):
            return
        for i, (p, index) in enumerate(masters):
            # On NVMe a partition's master and moments live on disk (DeepSpeed keeps small ones in host
            # memory): page them in around the step, as its own step does; paging out writes the new moments.
            paged = self.offload_optimizer == "nvme" and zero._swappable_optimizer_subgroup(i)
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
        if self.stage < 3:
            # DeepSpeed links each parameter to its slice of the optimizer state after its first
            # step; the state exists now, so link it now (ZeRO-3 looks slices up on each access).
            zero._lazy_init_hp_params_optimizer_state()

    def teardown(self) -> None:
        self._accumulating = None  # after a failed micro-step: never flush into ranks that may be gone
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
        self.engine = None  # type: ignore[assignment]
        if self._swap_dir is not None:
            import gc

            gc.collect()  # the swappers hold open files in the folder until collected
            shutil.rmtree(self._swap_dir, ignore_errors=True)
            self._swap_dir = None


@contextmanager
def _counting_reductions(counter: CommCounter) -> Iterator[None]:
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
            tensors = [payload] if isinstance(payload, torch.Tensor) else [t for t in payload if isinstance(t, torch.Tensor)]
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


def _count_parameters(model_config: dict[str, Any]) -> int:
    """Parameters of the configured model, built on the meta device (no memory, no initialisation cost)."""
    from hydra.utils import instantiate

    with torch.device("meta"):
        model = instantiate(model_config)
    return sum(p.numel() for p in model.parameters())


def _async_io_problem(device_type: str) -> str | None:
    """Why DeepSpeed's async I/O op (NVMe offload) cannot run here, or None."""
    os.environ.setdefault("DS_ACCELERATOR", device_type)  # no accelerator guess (and warning) in the launcher
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if installed_ops.get("async_io"):
        try:
            builder.load(verbose=False)
        except ImportError as e:  # a CPU-only DS_BUILD_AIO=1 build misses -laio (deepspeed 0.19.8)
            return (f"DeepSpeed's prebuilt async_io op does not load ({e}); reinstall deepspeed without DS_BUILD_AIO=1: "
                    "the op then compiles on first use")
    elif not builder.is_compatible(verbose=False):
        return ("NVMe offload needs DeepSpeed's async_io op, which needs libaio: install it "
                "(Debian/Ubuntu: apt-get install libaio-dev) and run again")
    return None
