"""The common runner: one training loop for every strategy, as a trainer with named phases.

It never asks which strategy it drives; everything layout-specific is behind the Strategy protocol. Logged figures
are reduced over all ranks: the loss is the mean over the whole global batch, memory figures are the maximum over
ranks.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig

from launcher.base.collectives import all_reduce, gather_rows
from launcher.base.durable import write_durably
from launcher.base.metrics import declared, over_ranks
from launcher.base.run_files import IN_PLACE
from launcher.base.targets import import_targets
from launcher.checkpoint.format import Position, manifest_of
from launcher.checkpoint.policy import SavePolicy, saver
from launcher.checkpoint.resume import check_shared_folders, restart_count, resume
from launcher.config.context import run_context
from launcher.data.sources import StepData
from launcher.evaluation.callbacks import Watch
from launcher.evaluation.passes import evaluation_of
from launcher.loggers.base import Loggers
from launcher.loggers.progress import Progress
from launcher.mixture.source_loss import SourceLosses
from launcher.models.loss import LabelRule, batch_tokens
from launcher.models.meta import build_on_meta
from launcher.optim.build import optimizer_factory
from launcher.optim.schedules import schedule_lr
from launcher.recovery.adapt import after_out_of_memory, resizing
from launcher.recovery.in_place import InPlace
from launcher.recovery.tier import MemoryTier
from launcher.search.trial import TrialReport, record_pruned
from launcher.telemetry.peak_memory import StepMemory, rss_bytes
from launcher.telemetry.profiling import MemorySnapshots, StepProfiler
from launcher.telemetry.speed import Speed, Window
from launcher.telemetry.stragglers import StepClock, Stragglers
from launcher.worker.feed import feed, next_step, training_source
from launcher.worker.guard import Guard
from launcher.worker.hangs import stuck_in_collective
from launcher.worker.lifecycle import Phase, StopRequest, joined
from launcher.worker.step import train_step
from strategies import RunContext, Strategy


def train(
    cfg: DictConfig,
    ctx: RunContext,
    strategy: Strategy,
    run_dir: Path,
    stop: StopRequest | None = None,
    phase: Phase | None = None,
    inherited: set[int] | None = None,
) -> bool:
    """Run the loop to `trainer.max_steps`; return False if a stop signal ended it early (after a checkpoint).
    `inherited`: the sockets the process held before its first process group (recovery in place never touches
    them)."""
    phase = phase or Phase(run_dir, ctx.rank)
    trainer = cfg.trainer
    snapshots = MemorySnapshots(
        trainer.memory_snapshot, trainer.memory_snapshot_step, run_dir, ctx.rank, ctx.device_type
    )
    snapshots.start()  # before the model exists: its allocations are in the history
    run = Trainer(cfg, ctx, strategy, run_dir, stop or StopRequest(), phase, snapshots, inherited)
    try:
        return run.run()
    except torch.OutOfMemoryError as e:
        phase.try_flush()
        after_out_of_memory(cfg, ctx, run_dir, phase.now)  # batch.micro_size=auto: the restarted group halves it
        error = snapshots.out_of_memory(e)
        error.launch_phase = phase.now  # type: ignore[attr-defined]
        raise error from e
    except Exception as e:
        phase.try_flush()  # where this rank was, for the other ranks' messages
        if (tier := getattr(run, "tier", None)) is not None:  # replicas: the survivor's state written once
            tier.on_failure(strategy)
        stuck = stuck_in_collective(e, phase, ctx, float(cfg.trainer.collective_timeout))
        if stuck is not None:  # who is stuck and where, not only that a collective gave up
            raise stuck from e
        e.launch_phase = getattr(e, "launch_phase", None) or phase.now  # type: ignore[attr-defined]
        raise


@dataclass
class StepState:
    """One optimizer step of the loop: its number, what it does beside training, and what its training gave."""

    number: int
    logged: bool
    """Its figures are reduced over ranks and logged (trainer.log_every, the first step, the last)."""
    evaluated: bool
    """The validation pass runs after it (trainer.eval_every, the last step)."""
    measured: bool
    """Its peak memory is measured (`Trainer.measured`)."""
    started: float = field(default_factory=time.perf_counter)
    """From the wait for its data on: a slow loader shows in its time."""
    loss: torch.Tensor | None = None
    """This rank's part of the step's loss (summed over ranks: the global batch's)."""
    grad_norm: float = 0.0
    """The global gradient norm before clipping."""


class Trainer:
    """One worker's run: `setup` builds everything once, then `run` takes one optimizer step at a time.

    A step's phases, in the order the collectives force (every rank makes the same collectives in the same order,
    so no phase may be skipped on one rank and not on the others):
      1. data        this rank's K micro-batches of global batch s (`next_step`; a collective where a stream ends);
      2. `step`      forward/backward per micro-step, the strategy's gradient sync on the last one, the optimizer
                     step (the global gradient norm); on logged steps a probe before the last backward, which times
                     each rank's wait (`launcher.telemetry.stragglers`);
      3. commit      whether the step was applied (`Guard.judge`; a collective only when the norm is not finite);
      4. `log`       on logged and evaluated steps only, on every rank alike: the figures reduced over ranks, and
                     the validation loss;
      5. `agree`     one all-reduce: whether any rank got a stop signal, whether any still writes a checkpoint,
                     whether a search's pruner ended the trial (rank 0 asked it in 4);
      6. `save`      what the save policy asks for, or the stop agreed in 5.
    The position advances once per step taken: a step not committed (trainer.nonfinite=skip) still
    consumes its samples; a step that was never taken leaves the position where it was, and the loop takes it
    again. Accumulation is the attempt's own (`RunContext.accumulation`): the samples of step s depend only on the
    seed and the global batch, so a worker group restarted with another K goes on with the same data.
    """

    def __init__(
        self,
        cfg: DictConfig,
        ctx: RunContext,
        strategy: Strategy,
        run_dir: Path,
        stop: StopRequest,
        phase: Phase,
        snapshots: MemorySnapshots,
        inherited: set[int] | None = None,
    ) -> None:
        self.cfg, self.ctx, self.strategy, self.run_dir = cfg, ctx, strategy, run_dir
        self.stop, self.phase, self.snapshots, self.trainer = stop, phase, snapshots, cfg.trainer
        self.device = torch.device(ctx.device)
        self.K, self.B, self.max_steps = ctx.accumulation, int(cfg.batch.global_size), int(cfg.trainer.max_steps)
        self.metrics: dict[str, float] = {}
        """The newest logged figures."""
        self.window = Window()
        self.started = time.time()
        self.stalled = False
        """A save (or its finalisation) blocked the loop since the last log: its seconds go in the next."""
        self.inherited = inherited
        """The sockets the process held before its first process group (`launcher.recovery.in_place`)."""

    def run(self) -> bool:
        """Steps up to trainer.max_steps; False if a stop signal ended the run early (after a checkpoint)."""
        self.setup()
        if self.evaluation is not None:  # what it reads; each metric on each set's first batch (a failure ends it)
            self.evaluation.check(self.strategy, self.rule)
        if self.trainer.eval_only:  # launch eval: the checkpoint's figures, no step
            at, ema = self.position.step, bool(self.trainer.eval_ema)
            self.evaluation.once(self.strategy, self.rule, at, self.run_dir, ema)  # type: ignore[union-attr]
            self.finish()
            return True
        self.watch.call("on_train_start", self.position.step, {})
        while self.position.step < self.max_steps:
            try:
                ended = self.one_step(self.plan_step(self.position.step + 1))
            except Exception as error:
                if not self.recover(error):
                    raise
                continue
            if ended is not None:
                return ended
        self.finish()
        return True

    def plan_step(self, number: int) -> StepState:
        """Step `number` and what it does beside training: log, evaluate, measure its peak memory."""
        logged, evaluated = self.logged(number), self.evaluated(number)
        return StepState(number, logged, evaluated, self.measured(number, logged or evaluated))

    def one_step(self, s: StepState) -> bool | None:
        """One optimizer step, in the order the collectives force: its batches, forward and backward over the
        micro-steps and the optimizer step, the position, the figures and the evaluation, the agreement, the save.
        None: the loop goes on; True: the run ended as it should (a stream ran out, an early stop, a pruned trial);
        False: a stop signal ended it after its checkpoint."""
        step = s.number
        with self.profiler.step(step):
            self.phase(f"reading the batches of step {step}")
            self.clock = StepClock(self.device) if s.logged or s.evaluated else None  # compute and waits, per rank
            data = next_step(self.steps, self.source, self.device)  # None: a stream ran out on some rank
            if data is not None:
                s.loss, s.grad_norm = self.step(s, data)
                self.guard.judge(step, s.grad_norm)  # a step that is not finite was not applied, or ends the run
                tokens = sum(batch_tokens(b) for b in data.micro)
                self.window.add(time.perf_counter() - s.started, tokens, s.measured)
        if data is None:  # a stream ran out: every rank agreed on it, before any forward of this step
            self.ended(step)
            return True
        self.profiler.ended(step)
        self.snapshots.after_step(step)
        # A step taken consumes its samples, applied or not (trainer.nonfinite=skip); data=mix: its tokens so far.
        self.position = Position(step, self.position.samples + self.B, self.source_losses.recorded(data, self.device))
        self.tier.after(self.position, self.strategy)  # the memory tier's step, in the background
        if s.logged or s.evaluated:
            self.log(s)
        self.progress.update(step, self.metrics if s.logged else None)
        stopping, pruned = self.agree(step)
        if self.watch.failed:  # a callback raised: what is in flight is finished, the newest complete stays last
            self.saves.finish()
            self.watch.fail(self.saves.last)
        if self.policy.due(step, stopping or pruned or self.watch.saves):  # a stop and a best step save
            self.save(step)
        if pruned or self.watch.stop:  # the study's pruner or the early stop ended the run: done, not interrupted
            self.pruned(step)
            return True
        if stopping and step < self.max_steps:
            self.stopped(step)
            return False
        return None

    # ------------------------------------------------------------------ before the first step

    def setup(self) -> None:
        """The data, the model wrapped by the strategy, the position to resume from, the loggers and the saver."""
        cfg, ctx, trainer, phase = self.cfg, self.ctx, self.trainer, self.phase
        phase("building the data")
        self.source = training_source(cfg)  # a permutation is data: held before the model is built
        self.evaluation = evaluation_of(cfg, ctx) if int(trainer.eval_every) > 0 or trainer.eval_only else None
        # What the process holds before the model exists: torch, and the data (host memory, as on a GPU machine).
        self.memory = StepMemory(self.device, ctx.compile)
        if int(cfg.derived.nodes) > 1:  # before the first save: where the nodes write together, they see one folder
            check_shared_folders(cfg, ctx, self.run_dir)
        self.build()
        self.loggers = Loggers.create(cfg, ctx.rank, self.run_dir)
        self.progress = Progress(ctx.rank, self.max_steps - self.position.step, trainer.progress)
        self.profiler = StepProfiler(
            trainer.profile_steps, self.run_dir, ctx.rank, ctx.device_type, trainer.profile_stacks
        )
        self.trial, self.prune, self.watch = TrialReport(cfg, ctx.rank), False, Watch.of(cfg, ctx.rank)
        self.stragglers = Stragglers.of(trainer, self.run_dir)
        self.in_place = InPlace.of(cfg, ctx, self.inherited)  # after every group of the run exists

    def build(self) -> None:
        """What the process group's size decides: the model wrapped by the strategy, the memory tier, the position
        resumed, the data feed at this size's accumulation, the saver and the step's guard. Again after a recovery in
        place, at the new size."""
        cfg, ctx, trainer, phase = self.cfg, self.ctx, self.trainer, self.phase
        phase("building the model")
        torch.manual_seed(cfg.seed)  # same initial weights on every rank and in a one-process run

        def build_model(meta: bool = False) -> Any:
            return build_on_meta(cfg.model) if meta else instantiate(cfg.model)

        with self.memory.imports_excluded(), self.memory.measure(True):
            # The model's module and everything it imports, imported now: DeepSpeed's zero.Init patches torch's
            # tensor constructors while the model is built, and a library imported first inside it fails.
            import_targets(cfg.model)
            self.strategy.setup(ctx, build_model, optimizer_factory(cfg, ctx))
        self.setup_peak, self.memory.peak = self.memory.peak, None  # logged with every step
        # Ranks may have drawn different random numbers while building (FSDP builds the whole model on rank 0 only):
        # the same generator state everywhere from here, whatever the strategy, as one process would have.
        torch.manual_seed(cfg.seed + 1)
        self.speed = Speed.of(cfg, ctx, self.strategy)
        self.tier = MemoryTier(cfg, ctx)  # trainer.memory_checkpoint_every: promoted first on a restart
        with self.memory.counted():  # the state a checkpoint brings is the steps' memory too
            self.position = resume(cfg, ctx, self.strategy, self.run_dir, self.tier)
        self.resumed_at = self.position.step
        self.rule = LabelRule.of(cfg.derived.model, trainer.get("loss"))  # decided in the launcher
        self.source_losses = SourceLosses.of(self.source, self.rule, self.position, ctx.rank, ctx.tensor_size)
        self.steps = feed(cfg, ctx, self.source, self.position, self.max_steps, self.K, self.device)
        self.saves = saver(cfg, ctx, self.run_dir, self.strategy, self.position.step)
        self.policy = SavePolicy.of(trainer)
        self.manifest = manifest_of(cfg, ctx.world_size, ctx.precision)
        self.nonfinite = str(trainer.get("nonfinite", "stop"))
        self.guard = Guard(
            self.strategy,
            self.nonfinite,
            int(trainer.get("max_skipped", 10)),
            ctx.precision == "fp16",
            ctx.rank,
            ctx.world_size,
        )

    def recover(self, error: Exception) -> bool:
        """Recovery in place (`launcher.recovery.in_place`) after `error`: the survivors re-form the group at their
        number and go on from the step resumed, in this process; False where this worker cannot (the error is
        raised, and torch's restart takes over)."""
        if self.in_place is None:
            return False
        failed = time.time()
        self.phase.try_flush()
        regrouped = self.in_place.regroup(error, lambda: self.tier.on_failure(self.strategy))
        if regrouped is None:
            return False
        rank, world, lost = regrouped
        self.phase(f"recovering in place from the loss of rank(s) {lost}")
        try:  # what the old group had in flight is abandoned: its peers are gone
            self.tier.close()
        except Exception:
            pass
        self.strategy.teardown()  # the same strategy, set up again by `build` at the new size
        gc.collect()
        dist.destroy_process_group()
        self.in_place.join(rank, world, "gloo")
        self.ctx = run_context(self.cfg, rank, self.ctx.local_rank, world, self.ctx.micro_size)
        self.K = self.ctx.accumulation
        self.phase.renumber(rank)
        joined(self.run_dir, rank)  # this rank's record (its node, its host) for the failure reports
        if self.evaluation is not None:
            self.evaluation = evaluation_of(self.cfg, self.ctx)
        self.build()
        self.in_place.publish()
        if rank == 0:
            nodes = world // max(1, int(self.ctx.local_world_size or 1))
            said = {"nodes": nodes, "world_size": world, "time": failed, "lost": self.in_place.lost}
            write_durably(self.run_dir / "logs" / IN_PLACE, json.dumps(said))
            gone = ", ".join(map(str, lost))
            print(
                f"launch: recovery in place: rank(s) {gone} lost; {world} rank(s) go on in their processes, "
                f"renumbered in order, from step {self.position.step} at accumulation {self.K}; "
                f"{time.time() - failed:.1f} s from the failure to the group re-formed and resumed",
                flush=True,
            )
        return True

    # ------------------------------------------------------------------ the phases of a step

    def measured(self, step: int, logged: bool) -> bool:
        """Whether the step's peak memory is measured: a logged step on CUDA (the allocator keeps the peak); on CPU,
        where the per-operator probe slows the step, the first logged step, the last and every
        trainer.memory_every-th."""
        if not logged:
            return False
        every = self.trainer.memory_every
        return self.device.type == "cuda" or not self.metrics or step == self.max_steps or step % every == 0

    def logged(self, step: int) -> bool:
        """trainer.log_every, the last step, and the first (the loss is seen at once)."""
        return step % self.trainer.log_every == 0 or step == self.max_steps or not self.metrics

    def evaluated(self, step: int) -> bool:
        every = int(self.trainer.eval_every)
        return every > 0 and (step % every == 0 or step == self.max_steps)

    def lr(self, step: int) -> float:
        return schedule_lr(self.trainer, self.cfg.optim.lr, step - 1, self.max_steps)

    def step(self, s: StepState, data: StepData) -> tuple[torch.Tensor, float]:
        """Forward/backward, gradient sync and optimizer step; this rank's part of the loss, and the gradient norm.
        Its peak memory is measured when `s.measured`; the others pay nothing. A profiled step's is not on CPU: the
        per-operator count would be in the profile, around every op of the step."""
        with self.memory.measure(s.measured, profiled=self.profiler.covers(s.number)):
            return train_step(
                self.guard,
                data.micro,
                self.ctx,
                self.rule,
                lr=self.lr(s.number),
                step=s.number,
                phase=self.phase,
                clock=self.clock,
                seen=self.source_losses.seer(data.sources, s.logged),
            )

    def log(self, s: StepState) -> None:
        """The step's figures over all ranks (`launcher.base.metrics` declares how each is reduced), then the
        loggers."""
        step, loss, grad_norm, evaluated = s.number, s.loss, s.grad_norm, s.evaluated
        self.phase(f"logging step {step}")
        metrics = self._figures(loss, grad_norm, self.lr(step))
        metrics |= self.speed.metrics(metrics.get("tokens_per_s"), self.ctx.world_size)
        if self.nonfinite == "skip":
            metrics["skipped_steps"] = self.guard.skipped
        metrics |= self.source_losses.figures(self.device, self.position.stream)  # data=mix: per source
        if evaluated:  # data=mix: each source's too; EMA: its weights' (`Evaluation.run`)
            metrics |= self.evaluation.run(self.strategy, self.rule)  # type: ignore[union-attr]
        for name in metrics:
            declared(name)  # a figure nobody declared is refused, not logged with a meaning nobody chose
        self.loggers.log(metrics, step)
        self.metrics, self.window = metrics, Window()
        self.watch.logged(step, metrics, evaluated)  # the early stop's judgement, the callbacks
        self.prune = self.trial.report(step, metrics, last=step == self.max_steps)  # rank 0 of a search's trial

    def agree(self, step: int) -> tuple[bool, bool]:
        """Every rank learns of a stop signal any rank got, and of a search's pruner ending the trial (rank 0 asks
        it), so all save the same step together; and whether any rank still writes the checkpoint in flight: once
        none does, it is made visible. (stop signal, pruned): the run stops here if either is true."""
        self.phase(f"agreeing whether to stop after step {step}")
        mine = [float(self.stop.signal is not None), float(self.saves.writing()), float(self.prune), *self.watch.flags]
        stopping, writing, pruned, *watched = all_reduce(mine, dist.ReduceOp.MAX, self.device)
        self.watch.agreed(watched)
        if self.saves.pending is not None and not writing:
            self.phase(f"making the checkpoint of step {self.saves.pending.position.step} visible")
            self.saves.finalise()
            self.stalled = True
        return bool(stopping), bool(pruned)

    def save(self, step: int) -> None:
        self.phase(f"saving the checkpoint of step {step}")
        with self.memory.imports_excluded():  # the writer's modules, imported by the first save, are no step's memory
            self.saves.save(self.position, self.strategy, self.manifest | self.watch.marks(step))
        self.stalled = True
        self.watch.call("on_save", step, self.metrics)

    def stopped(self, step: int) -> None:
        """A stop signal ended the run after `step`: its checkpoint written, and one line saying where it is."""
        self.phase(f"writing the checkpoint of step {step}")
        self.saves.finish()
        if self.ctx.rank == 0 and resizing(self.run_dir, self.started):
            print(
                f"launch: a node joins: the worker group saved step {step} ({self.saves.last}) and restarts at its "
                "new size",
                flush=True,
            )
        elif self.ctx.rank == 0:
            print(f"launch: stopped on a signal after step {step}; checkpoint {self.saves.last}", flush=True)
        self.finish("KILLED")

    def ended(self, step: int) -> None:
        """The stream ran out before a full global batch of `step`: the run ends after the step before it, on every
        rank, with that step's checkpoint, and one line (a mixture's names the source that ended it)."""
        last = step - 1
        if last > self.resumed_at and not self.policy.due(last, False):  # else saved already, or resumed from
            self.save(last)
        self.phase(f"writing the checkpoint of step {last}")
        self.saves.finish()
        if self.ctx.rank == 0:
            where = f"; checkpoint {self.saves.last}" if self.saves.last else ""
            why = getattr(self.source, "end", None) or f"the stream ended after {self.position.samples:,} samples"
            print(
                f"launch: data: {why}: step {last} trained its last full global batch of {self.B}, before "
                f"trainer.max_steps={self.max_steps}; the run ends here{where}",
                flush=True,
            )
        self.finish()

    def pruned(self, step: int) -> None:
        """The study's pruner ended this trial after `step`: its checkpoint written, a record for the sweeper, and
        one line."""
        self.phase(f"writing the checkpoint of step {step}")
        self.saves.finish()
        if self.ctx.rank == 0 and self.watch.stop:
            print(f"{self.watch.early.why(step)}; checkpoint {self.saves.last}", flush=True)
        elif self.ctx.rank == 0:
            name = str(self.cfg.sweep.objective)
            record_pruned(self.run_dir, step, name, self.metrics[name])
            print(
                f"launch: trial {self.cfg.sweep.trial} pruned after step {step} ({name} {self.metrics[name]:.4f}); "
                f"checkpoint {self.saves.last}",
                flush=True,
            )
        self.finish()

    def finish(self, status: str = "FINISHED") -> None:
        """The run ends with its last checkpoint written and visible, its progress line closed, its loggers done (told
        how it ended: FINISHED, or KILLED by a stop signal)."""
        if self.saves.pending is not None:
            self.phase(f"writing the checkpoint of step {self.saves.pending.position.step}")
            self.saves.finish()
        self.phase("finishing")
        self.tier.close()
        self.watch.call("on_train_end", self.position.step, self.metrics)
        self.watch.settle(self.device, self.saves.last)  # a callback that raised since the last agreement ends it
        self.progress.close()
        self.loggers.finish(status)

    # ------------------------------------------------------------------ figures

    def _gather(self, values: list[float]) -> list[list[float]]:
        return gather_rows(values, self.device)

    def _figures(self, loss_part: torch.Tensor, grad_norm: float, lr: float) -> dict[str, float]:
        """The step's figures over all ranks: this rank's, reduced by their declarations (the loss: every rank's
        part summed, `launcher.models.loss`; memory, the strategy's figures and a save's stall: the largest rank's)."""
        mine = {"loss": loss_part.item(), "rss_bytes": float(rss_bytes())}
        if self.setup_peak is not None:
            mine["setup_peak_bytes"] = float(self.setup_peak)
        if self.memory.peak is not None:
            mine["peak_memory_bytes"] = float(self.memory.peak)
        if self.memory.heap_other is not None:
            mine["heap_other_bytes"] = float(self.memory.heap_other)
        if self.stalled:  # a save (or its finalisation) blocked the loop since the last log
            mine["checkpoint_stall_s"], self.saves.stall, self.stalled = self.saves.stall, 0.0, False
        mine |= self.strategy.metrics() | self.clock.figures()  # type: ignore[union-attr]
        reduced, (tokens,), rows = over_ranks(mine, self._gather, [self.window.tokens()], self.clock.times())  # type: ignore[union-attr]
        if self.ctx.rank == 0 and (straggler := self.stragglers.see(rows)):
            print(straggler, flush=True)
        reduced |= self.window.figures(self.B, tokens / self.ctx.tensor_size)  # a tensor-parallel group: one batch
        return {
            "loss": reduced.pop("loss"),
            "lr": lr,
            "grad_norm": grad_norm,
            "accumulation": self.ctx.accumulation,
            "micro_size": self.ctx.micro_size,
            "world_size": self.ctx.world_size,
            "restart": restart_count(),  # which attempt of the worker group logged the step
            **reduced,
        }
