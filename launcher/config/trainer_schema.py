"""The typed schema of the trainer's settings (`trainer.*`), which `launcher.config.schema` holds under the run's
config."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from launcher.config.ranges import COUNT, EVAL_BATCHES, OPEN_UNIT, POSITIVE, SIZE, UNIT, launch_only, ranged


class NonFinite(Enum):
    stop = "stop"
    """End the run with one line (step, micro-step, ranks); the newest checkpoint stays the last finite one."""
    skip = "skip"
    """Drop the step (no parameter or optimizer-state change), log skipped_steps; stop after max_skipped in a row."""


class Recovery(Enum):
    restart = "restart"
    """A failure ends the worker group; torch's elastic agent starts it again (trainer.max_restarts, nodes=min:max)."""
    in_place = "in_place"
    """The surviving workers keep their processes, re-form the group at their number and go on from the last step
    complete (`launcher.recovery.in_place`); CPU (gloo) runs of more than one rank; the restart is the fallback."""


class Schedule(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"
    """Warmup, stable at optim.lr, then decay over trainer.decay_steps (or trainer.decay_fraction) at the end."""
    inverse_sqrt = "inverse_sqrt"
    """Warmup, then optim.lr x sqrt(warmup_steps / step)."""
    custom = "custom"
    """trainer.schedule_fn: a function of (step, max_steps) by _target_, returning the fraction of optim.lr."""


class DecayShape(Enum):
    linear = "linear"
    sqrt = "sqrt"
    """1 - sqrt(progress): stays high longer, then falls fast."""
    cosine = "cosine"


@dataclass
class EMAConfig:
    decay: float | None = ranged(None, OPEN_UNIT)
    """Keep an fp32 exponential moving average of the trainable parameters (held as the strategy holds them), with
    this decay per update; validated too (val_ema_loss), saved and resumed; `launch convert CKPT ema=true` exports it.
    Unset: none."""
    every: int = ranged(1, SIZE)
    """Update the average every N optimizer steps."""
    start: int = ranged(0, COUNT)
    """Up to this optimizer step the average is the weights themselves; it averages after it."""


class Direction(Enum):
    min = "min"
    """Lower is better (a loss)."""
    max = "max"
    """Higher is better (an accuracy)."""


@dataclass
class EarlyStopConfig:
    """trainer.early_stop: end the run when a logged figure stops improving (`launcher.evaluation.callbacks`)."""

    metric: str | None = None
    """The figure watched (val_loss, val/accuracy, val/<set>/<metric>...); unset: no early stop."""
    mode: Direction = Direction.min
    """min: lower is better; max: higher is better."""
    patience: int = ranged(3, SIZE)
    """Evaluations (logged steps, for a training figure) in a row without improvement before the run stops."""
    min_delta: float = ranged(0.0, COUNT)
    """An improvement is a change by more than this."""


@dataclass
class TrainerConfig:
    max_steps: int = ranged(300, SIZE, identity=False)
    """Optimizer steps to run."""
    log_every: int = ranged(10, SIZE, identity=False)
    """Log metrics every N optimizer steps (the last step is always logged)."""
    eval_every: int = ranged(100, COUNT, identity=False)
    """Validation loss every N optimizer steps (and at the end); 0 disables."""
    eval_batches: Any = ranged(4, EVAL_BATCHES, identity=False)
    """Global batches in one validation pass, from each set's start (the same samples whatever the world size), or
    `all`: every sample. Each sample counts once: a set shorter than that is read once, whole (said at start), and a
    partial last batch counts its samples alone."""
    metrics: dict[str, Any] = launch_only(factory=dict)
    """Validation metrics, each under its name: a torchmetrics `Metric` by `_target_` with its keys, or a function
    of (output, batch) returning (sum, count); `preds` and `target` say where the metric's inputs are in the model's
    output and in the batch (a key, an attribute or a position; unset: found, and said once). Reduced over ranks
    exactly (`launcher.evaluation.metrics`); logged as val/<name>, or val/<set>/<name> with several sets."""
    early_stop: EarlyStopConfig = launch_only(factory=EarlyStopConfig)
    """Stop when trainer.early_stop.metric stops improving; the best step's checkpoint is kept and named `best`."""
    callbacks: list[Any] = launch_only(factory=list)
    """Objects of yours (`_target_`s) called at the trainer's phases: any of on_train_start, on_step_end,
    on_eval_end, on_save, on_train_end, each with (step, figures); on rank 0, or on every rank where the class sets
    `every_rank = True` (`launcher.evaluation.callbacks`)."""
    eval_only: bool = launch_only(False)
    """Set by `launch eval CHECKPOINT`: the checkpoint evaluated once, no step trained; eval.json in the run dir."""
    eval_ema: bool = launch_only(False)
    """Set by `launch eval CHECKPOINT ema=true`: the evaluation on the checkpoint's EMA weights (the run's
    trainer.ema), its figures named as the run logs them (val_ema_loss, val/ema/<metric>)."""
    loss: Any = None
    """Where the loss is in the model's output: a key, an attribute or a position (nanoGPT's `(logits, loss)`: 1);
    unset: a scalar, `loss`, (loss_sum, num_tokens), or a tuple's only scalar tensor (said once)."""
    grad_clip: float = ranged(1.0, COUNT)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    schedule: Schedule = Schedule.cosine
    """Learning-rate shape after warmup."""
    warmup_steps: int = ranged(20, COUNT)
    """Linear warmup from 0 to optim.lr over this many steps."""
    min_lr_ratio: float = ranged(0.1, UNIT)
    """Final learning rate as a fraction of optim.lr (cosine, linear and wsd schedules)."""
    decay_steps: int | None = ranged(None, SIZE)
    """trainer.schedule=wsd: the last steps, over which the rate decays; unset: trainer.decay_fraction of max_steps."""
    decay_fraction: float = ranged(0.2, UNIT)
    """trainer.schedule=wsd without trainer.decay_steps: the fraction of trainer.max_steps the decay takes."""
    decay_shape: DecayShape = DecayShape.linear
    """trainer.schedule=wsd: how the rate falls in the decay (linear, sqrt: 1 - sqrt(progress), cosine)."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """EMA weights: trainer.ema.decay=0.999 turns them on."""
    schedule_fn: Any = None
    """trainer.schedule=custom: {_target_: module.function, ...its keys}, called as function(step, max_steps,
    **keys) with the 0-based step; returns the fraction of optim.lr (it owns warmup). No state: resumes are exact."""
    max_restarts: int = ranged(0, COUNT, identity=False)
    """Times the elastic agent restarts the worker group after a failure."""
    fork_workers: bool = launch_only(True)
    """On CPU, workers are forked from the launcher (torch already imported); false: started afresh, as on CUDA."""
    collective_timeout: float = ranged(600.0, POSITIVE, identity=False)
    """Seconds a collective may wait before the process group gives up."""
    progress: bool = launch_only(True)
    """Show a progress bar on rank 0."""
    checkpoint_every: int = ranged(0, COUNT, identity=False)
    """Save a checkpoint every N optimizer steps (0: only at the end)."""
    save_at_end: bool = launch_only(True)
    """Save a checkpoint after the last step; false for smoke runs (a stop signal still saves)."""
    stop_timeout: int = ranged(120, SIZE, identity=False)
    """Seconds workers get, after a stop signal, to finish the step and save before they are killed."""
    keep_last: int = ranged(2, COUNT, identity=False)
    """Complete checkpoints kept in the run directory; older ones are deleted (0 keeps all)."""
    checkpoint_dir: str | None = launch_only(None)
    """Where checkpoints go: a local folder or an fsspec URL (s3://bucket/prefix, gs://...); unset:
    <run dir>/checkpoints. Credentials come from the environment, never from here."""
    async_checkpoint: bool = launch_only(False)
    """Save checkpoints in the background (DCP's async_save): the state is copied to host memory, the loop goes on
    while it is written, and the checkpoint becomes visible (manifest, `latest`) once every rank's write is over;
    one save in flight at a time, the end of the run and a stop wait for it."""
    memory_checkpoint_every: int = ranged(0, COUNT, identity=False)
    """Keep each rank's state of every Nth step in its node's shared memory and memory_replicas other nodes', written
    in the background; a restart resumes from the newest step complete there (0: off)."""
    recovery: Recovery = launch_only(Recovery.restart)
    """What a lost peer costs: restart (the elastic agent restarts every worker) or in_place (the survivors go on in
    their processes at the new size: seconds, no worker started again)."""
    memory_replicas: int | None = ranged(None, COUNT, identity=False)
    """Other nodes that keep a copy of each node's memory-tier state (the next ones in a ring); unset: 1 on a
    multi-node job, 0 on one node."""
    compile: bool = launch_only(False)
    """torch.compile each transformer block (the strategy's units), after activation checkpointing, before sharding."""
    peak_tflops: float | None = ranged(None, POSITIVE, identity=False)
    """Peak FLOPS per device, in TFLOPS, for the logged MFU; unset: looked up by GPU name (none on CPU)."""
    profile_steps: list[int] | None = launch_only(None)
    """[first, last]: torch.profiler over those optimizer steps on every rank, one trace per rank in
    <run dir>/profile/, rank 0's top ops printed; unset: no profiler (and no cost)."""
    profile_stacks: bool = launch_only(False)
    """Record Python stacks in the profile too (larger traces)."""
    memory_every: int = ranged(50, SIZE, identity=False)
    """On CPU, the logged steps whose peak memory is measured: the first, the last and every Nth step (the
    per-operator probe costs about a fifth of a step); on CUDA every logged step (the allocator keeps the peak)."""
    memory_snapshot: bool = launch_only(False)
    """CUDA: record the allocator's history from the start, and dump a snapshot into <run dir>/memory/ at
    memory_snapshot_step and on an out-of-memory error (view it at pytorch.org/memory_viz)."""
    memory_snapshot_step: int | None = ranged(None, SIZE, identity=False)
    """The optimizer step after which a snapshot is dumped; unset: only on an out-of-memory error."""
    nonfinite: NonFinite = launch_only(NonFinite.stop)
    """A step whose loss (on any rank) or gradient norm is NaN or Inf is never applied; then stop the run, or skip
    the step. Under precision=fp16 a gradient overflow with finite losses is the loss scaler's own skip, not this."""
    max_skipped: int = ranged(10, SIZE, identity=False)
    """trainer.nonfinite=skip: stop after this many non-finite steps in a row."""
    straggler_fraction: float | None = ranged(0.2, COUNT, identity=False)
    """A rank whose seconds computing in a logged step exceed the median of the other ranks' by more than this
    fraction, in straggler_steps logged steps in a row, is named in one line (`launcher.telemetry.stragglers`); 0 or
    null: never named (the logged compute_s and wait_s figures stay)."""
    straggler_steps: int = ranged(3, SIZE, identity=False)
    """Logged steps in a row a rank must straggle in before it is named."""
