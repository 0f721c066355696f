"""The common runner: one training loop for every strategy.

It never asks which strategy it drives; everything layout-specific is behind the Strategy
protocol. Logged figures are reduced over all ranks: the loss is the mean over the whole global
batch, memory figures are the maximum over ranks.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from launcher.checkpoint import Position
from launcher.data import (
    BUILT_IN_DATA,
    GlobalBatches,
    StepBatches,
    build_dataset,
    check_token_ids,
    collate,
    feed,
    rank_micro_batches,
)
from launcher.guard import Guard
from launcher.lifecycle import Phase, StopRequest
from launcher.logs import Loggers, Progress
from launcher.loss import (
    NUM_ITEMS,
    LabelRule,
    batch_tokens,
    count_targets,
    micro_loss,
    model_loss,
    say_once,
    target_tokens,
    usual_recipe_line,
)
from launcher.memory import StepMemory, rss_bytes
from launcher.meta import build_on_meta
from launcher.plan.costs import GPT_TARGET, flops_per_token, peak_tflops, step_comm_bytes
from launcher.profiling import MemorySnapshots, StepProfiler
from launcher.resume import check_shared_directory, manifest_of, restart_count, resume, saver
from strategies import RunContext, Strategy


def lr_at(step: int, base: float, warmup: int, max_steps: int, schedule: str, min_ratio: float) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warmup, then the chosen decay."""
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    progress = (step - warmup) / max(1, max_steps - warmup - 1)
    progress = min(1.0, progress)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return base * (min_ratio + (1 - min_ratio) * shape)


@dataclass(frozen=True)
class Speed:
    """What turns a logged step into MFU, and the planner's figures beside the measured ones: worked out once."""

    flops_per_token: float
    peak_flops: float | None
    """Per device; None (no MFU logged) on a device the table does not know, unless trainer.peak_tflops is set."""
    comm_bytes_formula: float
    """The planner's bytes each rank sends per optimizer step for this strategy's layout (`launch plan`'s figure)."""
    plan_peak_bytes: float | None = None
    """The planner's peak per rank for this run (computed by the launcher), beside the measured peak_memory_bytes."""

    @classmethod
    def of(cls, cfg: DictConfig, ctx: RunContext, strategy: Strategy) -> Speed:
        params = int(cfg.derived.model.params)  # counted on the meta device by the launcher, tied weights once
        model = cfg.model
        gpt = model._target_ == GPT_TARGET
        shape = (model.n_layer, model.n_embd, model.block_size) if gpt else ()  # user models: 6 x parameters only
        peak = cfg.trainer.peak_tflops
        if peak is None and ctx.device_type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(ctx.device))
        layout, gpus = strategy.layout(), ctx.local_world_size
        formula = step_comm_bytes(params, ctx.world_size, layout, ctx.precision, ctx.accumulation, gpus)
        planned = OmegaConf.select(cfg, "derived.plan_peak_bytes", default=None)
        return cls(flops_per_token(params, *shape), peak * 1e12 if peak else None, formula, planned)

    def metrics(self, tokens_per_s: float | None, world_size: int) -> dict[str, float]:
        figures = {"comm_bytes_formula": self.comm_bytes_formula}
        if self.plan_peak_bytes is not None:
            figures["plan_peak_bytes"] = self.plan_peak_bytes
        if self.peak_flops and tokens_per_s is not None:
            # tokens_per_s is over all ranks; the peak is one device's.
            figures["mfu"] = self.flops_per_token * tokens_per_s / (world_size * self.peak_flops)
        return figures


def optimizer_factory(cfg: DictConfig, ctx: RunContext) -> functools.partial[Any]:
    """The configured optimizer as a partial over parameters (strategies may read its keywords), built by
    `build_optimizer`.

    The fused kernel where the optimizer has one (torch's Adam, AdamW, SGD, Adagrad), the user did not choose, and
    the parameters take it: one pass over each parameter, in place, on CUDA and on the CPU alike. The per-tensor loop
    it replaces allocates temporaries as large as the tensor it steps, which for DeepSpeed's flat partitions is the
    whole partition.
    """
    partial = instantiate(cfg.optim, _partial_=True, _convert_="all")
    if partial.args:  # positional hyperparameters: called as configured
        return partial
    fusable = "fused" in inspect.signature(partial.func).parameters and "fused" not in partial.keywords
    # Not under fp16's loss scaler on the CPU: the fused CPU kernels reject the scaler's found-inf tensor's shape.
    fuse = fusable and (ctx.device_type == "cuda" or (ctx.device_type == "cpu" and ctx.precision != "fp16"))
    return functools.partial(build_optimizer, partial.func, fuse=fuse, **partial.keywords)


def build_optimizer(
    optimizer: type[torch.optim.Optimizer], params: Any, fuse: bool = False, **kwargs: Any
) -> torch.optim.Optimizer:
    """`optimizer(params, **kwargs)` over the trainable parameters only, as DeepSpeed's ZeRO optimizers hold them: a
    frozen parameter has no optimizer state in any strategy, and a checkpoint's param groups load under every one.

    With `fuse`, the fused kernel, unless a parameter is a DTensor (FSDP's shards) and DTensor has no sharding rule
    for the optimizer's fused kernel (torch 2.13: Adam's and AdamW's only; SGD's and Adagrad's fail in the first
    step). Decided from the parameters themselves, whichever strategy built them."""
    from torch.distributed.tensor import DTensor

    groups = [
        {**item, "params": [p for p in item["params"] if p.requires_grad]} if isinstance(item, dict) else item
        for item in params
        if isinstance(item, dict) or item.requires_grad
    ]
    flat = [p for item in groups for p in (item["params"] if isinstance(item, dict) else [item])]
    if fuse and (not any(isinstance(p, DTensor) for p in flat) or _dtensor_fuses(optimizer)):
        kwargs["fused"] = True
    return optimizer(groups, **kwargs)


def _dtensor_fuses(optimizer: type) -> bool:
    """Whether DTensor dispatches the optimizer's fused kernel (torch names it `_fused_<class name>_`)."""
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, f"_fused_{optimizer.__name__.lower()}_", None)
    if op is None:
        return False
    rules = DTensor._op_dispatcher.sharding_propagator  # private; checked against torch 2.13
    tables = (rules.op_strategy_funcs, rules.op_single_dim_strategy_funcs, rules.op_to_rules)
    return any(op.default in table for table in tables)


def import_targets(node: Any) -> None:
    """Import every `_target_` in a config node (nested ones too: a transformers model's config)."""
    from hydra._internal.utils import _locate

    if isinstance(node, DictConfig):
        if "_target_" in node:
            _locate(str(node._target_))
        for key in node:
            import_targets(node.get(key))


def _reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def evaluate(
    strategy: Strategy, val_set: Any, ctx: RunContext, batches: int, global_size: int, rule: LabelRule
) -> float:
    """The loss over `batches` fixed global batches of the validation split, by the training step's rule
    (`launcher.loss`): Σ token losses / Σ targets where the model returns sums or its mean is over targets the
    launcher counts (its labels, by `rule`), else the mean of the micro-batches' means."""
    device = torch.device(ctx.device)
    strategy.train(False)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in range(batches):
            indices = np.arange(b * global_size, (b + 1) * global_size) % len(val_set)
            for micro in rank_micro_batches(indices, ctx.rank, ctx.world_size, ctx.accumulation):
                batch = collate(val_set, micro, device)
                loss, tokens = model_loss(strategy.forward(batch))
                targets, known = target_tokens(batch, rule.label_shift)
                if tokens is None and known:  # a mean over the counted targets: back to their sum (none: 0, not NaN)
                    loss, tokens = (loss * targets if targets else torch.zeros(())), torch.tensor(targets)
                total, count = total + float(loss), count + (float(tokens) if tokens is not None else 1.0)
    strategy.train(True)
    total, count = _reduce([total, count], dist.ReduceOp.SUM, device)
    return total / count


def optimizer_step(
    strategy: Strategy, micro: list[Any], ctx: RunContext, lr: float, rule: LabelRule, step: int, phase: Phase
) -> tuple[torch.Tensor, float]:
    """One optimizer step over this rank's K micro-batches; returns this rank's part of the step's loss (summed over
    ranks it is the loss of the whole global batch: `launcher.loss`) and the pre-clip gradient norm."""
    device, K = torch.device(ctx.device), len(micro)
    # The global batch's targets, counted before the first forward: each micro-step's loss is scaled so that the
    # step's gradient is that of one forward over the whole global batch.
    targets = count_targets(micro, ctx.world_size, lambda v: _reduce(v, dist.ReduceOp.SUM, device), rule.label_shift)
    divided = targets.counted and rule.takes_num_items and all(targets.labels)
    loss_sum, normalised = torch.zeros((), dtype=torch.float64, device=device), False
    for k, batch in enumerate(micro):
        phase(f"in forward/backward of step {step}, micro-step {k + 1}/{K}")
        if divided:  # a transformers model divides its summed loss by this itself
            batch = {**batch, NUM_ITEMS: targets.total / ctx.world_size}
        # Gradients are synchronised once per optimizer step: on the last micro-step only.
        with strategy.sync(k == K - 1):
            backward, part, normalised = micro_loss(strategy.forward(batch), k, targets, K, divided)
            strategy.backward(backward)
        loss_sum += part.double()
    if not normalised and ctx.rank == 0:
        say_once(usual_recipe_line(targets))
    phase(f"in the optimizer step {step}")
    grad_norm = strategy.step(lr)
    return loss_sum / (targets.total if normalised else ctx.world_size), grad_norm


@dataclass
class Window:
    """The steps since the last log: their times and tokens. Steps whose memory was measured are slowed by the
    measuring, so they are left out of the speed figures whenever the window has others."""

    steps: list[tuple[float, int, bool]] = field(default_factory=list)
    """(seconds, this rank's tokens, measured) per step."""

    def add(self, seconds: float, tokens: int, measured: bool) -> None:
        self.steps.append((seconds, tokens, measured))

    def figures(self, global_size: int, all_reduce: Any) -> dict[str, float]:
        kept = [s for s in self.steps if not s[2]] or self.steps
        seconds = sum(s[0] for s in kept)
        (tokens,) = all_reduce([float(sum(s[1] for s in kept))])
        figures = {"step_time_s": seconds / len(kept), "samples_per_s": global_size * len(kept) / seconds}
        if tokens:  # only batches of integer token ids have tokens to count (not images, not features)
            figures["tokens_per_s"] = tokens / seconds
        return figures


def train(
    cfg: DictConfig,
    ctx: RunContext,
    strategy: Strategy,
    run_dir: Path,
    stop: StopRequest | None = None,
    phase: Phase | None = None,
) -> bool:
    """Run the loop to `trainer.max_steps`; return False if a stop signal ended it early (after a checkpoint)."""
    phase = phase or Phase(run_dir, ctx.rank)
    trainer = cfg.trainer
    snapshots = MemorySnapshots(
        trainer.memory_snapshot, trainer.memory_snapshot_step, run_dir, ctx.rank, ctx.device_type
    )
    snapshots.start()  # before the model exists: its allocations are in the history
    try:
        return _train(cfg, ctx, strategy, run_dir, stop or StopRequest(), phase, snapshots)
    except torch.OutOfMemoryError as e:
        phase.try_flush()
        error = snapshots.out_of_memory(e)
        error.launch_phase = phase.now  # type: ignore[attr-defined]
        raise error from e
    except Exception as e:
        phase.try_flush()  # where this rank was, for the other ranks' messages
        if _collective_timeout(e, time.time() - phase.state[0], float(cfg.trainer.collective_timeout)):
            # Say who is stuck and where, not only that a collective gave up.
            recorder = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") if ctx.device_type == "cuda" else None
            dumps = (
                f"; NCCL's flight recorder dumps: {Path(recorder).parent} (torchfrtrace reads them)" if recorder else ""
            )
            stuck = RuntimeError(
                f"rank {ctx.rank} waited {cfg.trainer.collective_timeout:g} s in a collective while {phase.now}, "
                f"then gave up; {phase.others()}{dumps}"
            )
            stuck.launch_phase = phase.now  # type: ignore[attr-defined]
            raise stuck from e
        e.launch_phase = getattr(e, "launch_phase", None) or phase.now  # type: ignore[attr-defined]
        raise


def _collective_timeout(error: BaseException, waited: float, timeout: float) -> bool:
    """A collective that gave up after trainer.collective_timeout: torch's own error types for it (NCCL's
    DistBackendError, the store's DistNetworkError and DistStoreError), or gloo's, a plain RuntimeError, raised from
    torch's code (a collective, or the backward that runs DDP's); and this rank waited that long in its phase. Never
    an error of a library that merely says "timed out" (wandb, a dataset's download)."""
    if waited < timeout:
        return False
    if isinstance(error, dist.DistError):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    inner = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return type(error) is RuntimeError and inner.split(".")[0] == "torch"


def _train(
    cfg: DictConfig,
    ctx: RunContext,
    strategy: Strategy,
    run_dir: Path,
    stop: StopRequest,
    phase: Phase,
    snapshots: MemorySnapshots,
) -> bool:
    device = torch.device(ctx.device)
    trainer, K, B = cfg.trainer, ctx.accumulation, cfg.batch.global_size
    phase("building the data")
    train_set = build_dataset(cfg.data, "train")
    val_set = build_dataset(cfg.data, "val")
    batches = GlobalBatches(len(train_set), B, cfg.seed)
    # What the process holds before the model exists: torch, and the data (host memory, as on a GPU machine).
    memory = StepMemory(device, ctx.compile)

    check_shared_directory(run_dir, ctx, int(cfg.derived.nodes))
    phase("building the model")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and in a one-process run

    def build_model(meta: bool = False) -> Any:
        return build_on_meta(cfg.model) if meta else instantiate(cfg.model)

    with memory.imports_excluded(), memory.measure(True, sampled=True):
        # The model's module and everything it imports, imported now: DeepSpeed's zero.Init patches torch's tensor
        # constructors while the model is built, and a library imported first inside it (transformers) fails.
        import_targets(cfg.model)
        strategy.setup(ctx, build_model, optimizer_factory(cfg, ctx))
    setup_peak, memory.peak = memory.peak, None  # building and wrapping the model: logged with every step
    # Ranks may have drawn different random numbers while building (FSDP builds the whole model on rank 0 only):
    # the same generator state everywhere from here, whatever the strategy, as one process would have.
    torch.manual_seed(cfg.seed + 1)
    speed = Speed.of(cfg, ctx, strategy)
    position = resume(cfg, ctx, strategy, run_dir)
    loggers = Loggers.create(cfg, ctx.rank, run_dir)
    progress = Progress(ctx.rank, trainer.max_steps - position.step, trainer.progress)
    schedule = str(trainer.schedule)
    rule = LabelRule.of(cfg.derived.model)  # how the model counts its labels: decided once, in the launcher
    steps = StepBatches(batches, position.samples, trainer.max_steps - position.step, ctx.rank, ctx.world_size, K)
    vocab = OmegaConf.select(cfg, "derived.vocab_size", default=None)
    check = None  # the built-in data's largest id was checked before start; other data's ids are checked here
    if vocab is not None and not str(cfg.data._target_).startswith(BUILT_IN_DATA):

        def check(batch: Any, n: int, first: int = position.step + 1) -> None:
            check_token_ids(batch, vocab, first + n // K)

    micro_batches = feed(train_set, steps, int(cfg.data.get("workers", 0)), device, check)

    profiler = StepProfiler(trainer.profile_steps, run_dir, ctx.rank, ctx.device_type, trainer.profile_stacks)
    metrics: dict[str, float] = {}
    window = Window()
    saves, manifest = saver(cfg, ctx, run_dir, strategy, position), manifest_of(cfg, ctx)
    nonfinite = str(trainer.get("nonfinite", "stop"))
    guard = Guard(strategy, nonfinite, int(trainer.get("max_skipped", 10)), ctx.precision == "fp16", ctx.rank,
                  ctx.world_size)  # fmt: skip
    stalled = False  # a save (or its finalisation) blocked the loop since the last log: its seconds go in the next
    for step in range(position.step + 1, trainer.max_steps + 1):
        lr = lr_at(step - 1, cfg.optim.lr, trainer.warmup_steps, trainer.max_steps, schedule, trainer.min_lr_ratio)
        last = step == trainer.max_steps
        log_now = step % trainer.log_every == 0 or last or not metrics  # the first step: see the loss at once
        evaluate_now = trainer.eval_every > 0 and (step % trainer.eval_every == 0 or last)
        with profiler.step(step):
            phase(f"reading the batches of step {step}")
            started = time.perf_counter()  # from the wait for the data on: a loader that cannot keep up shows here
            micro = [next(micro_batches) for _ in range(K)]
            # The logged steps' peak; the others pay nothing. A profiled step's is sampled by a thread on CPU: the
            # per-operator probe would be in the profile, around every op of the step.
            with memory.measure(log_now or evaluate_now, sampled=profiler.covers(step)):
                loss, grad_norm = optimizer_step(guard, micro, ctx, lr, rule, step, phase)  # type: ignore[arg-type]
            # Before anything is logged or saved: a step that is not finite was not applied, and may end the run.
            guard.judge(step, grad_norm)
            window.add(time.perf_counter() - started, sum(batch_tokens(b) for b in micro), log_now or evaluate_now)
        profiler.ended(step)
        snapshots.after_step(step)
        position = Position(step, position.samples + B)

        if log_now or evaluate_now:
            phase(f"logging step {step}")
            metrics = _step_metrics(ctx, strategy, loss, grad_norm, lr, memory, setup_peak, device)
            metrics |= window.figures(B, lambda v: _reduce(v, dist.ReduceOp.SUM, device))
            metrics |= speed.metrics(metrics.get("tokens_per_s"), ctx.world_size)
            if nonfinite == "skip":
                metrics["skipped_steps"] = guard.skipped
            if evaluate_now:
                metrics["val_loss"] = evaluate(strategy, val_set, ctx, trainer.eval_batches, B, rule)
            if stalled:  # the slowest rank's: every rank waits for it at the next collective
                (metrics["checkpoint_stall_s"],) = _reduce([saves.stall], dist.ReduceOp.MAX, device)
                saves.stall, stalled = 0.0, False
            loggers.log(metrics, step)
            window = Window()
        progress.update(step, metrics if log_now else None)
        phase(f"agreeing whether to stop after step {step}")
        # Every rank learns of a stop signal any rank got, so all save the same step together; and whether any rank
        # still writes the checkpoint in flight: once none does, it is made visible.
        stopping, writing = _reduce([float(stop.signal is not None), float(saves.writing())], dist.ReduceOp.MAX, device)
        if saves.pending is not None and not writing:
            phase(f"making the checkpoint of step {saves.pending.position.step} visible")
            saves.finalise()
            stalled = True
        every = trainer.checkpoint_every > 0 and step % trainer.checkpoint_every == 0
        if (last and trainer.save_at_end) or stopping or every:
            phase(f"saving the checkpoint of step {step}")
            saves.save(position, strategy, manifest)
            stalled = True
            if stopping and not last:
                phase(f"writing the checkpoint of step {step}")
                saves.finish()
                if ctx.rank == 0:
                    print(f"launch: stopped on a signal after step {step}; checkpoint {saves.last}", flush=True)
                break
    else:
        stopping = False

    if saves.pending is not None:
        phase(f"writing the checkpoint of step {saves.pending.position.step}")
        saves.finish()  # the run ends with its last checkpoint written and visible
    phase("finishing")
    progress.close()
    loggers.finish()
    return not stopping or position.step == trainer.max_steps


def _step_metrics(
    ctx: RunContext,
    strategy: Strategy,
    loss_part: torch.Tensor,
    grad_norm: float,
    lr: float,
    memory: StepMemory,
    setup_peak: int | None,
    device: torch.device,
) -> dict[str, float]:
    """The step's figures over all ranks: the loss is the sum of every rank's part (`launcher.loss`), memory figures
    (the step's peak, the setup's, the RSS) are the maximum over ranks."""
    (loss,) = _reduce([loss_part.item()], dist.ReduceOp.SUM, device)
    extra = strategy.metrics()
    if memory.peak is not None:
        extra = {"peak_memory_bytes": float(memory.peak), **extra}
    if setup_peak is not None:
        extra = {"setup_peak_bytes": float(setup_peak), **extra}
    names = ["rss_bytes", *extra]
    maxima = _reduce([float(rss_bytes()), *extra.values()], dist.ReduceOp.MAX, device)
    return {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "accumulation": ctx.accumulation,
        "world_size": ctx.world_size,
        "restart": restart_count(),  # which attempt of the worker group logged the step
        **dict(zip(names, maxima)),
    }
