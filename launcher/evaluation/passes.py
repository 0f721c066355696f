"""The evaluation: the validation loss and the metrics of the user's choice over each validation set, by the training
step's loss rule (`launcher.models.loss`) and reduced over ranks exactly (`launcher.evaluation.metrics`), so that
its figures are one process's at any world size and under any strategy.

Each sample counts once (`launcher.data.sources`: `evaluation`): a pass reads a set's first trainer.eval_batches
global batches, or all of it (`all`), and a set shorter than that once, whole; nothing wraps. The last global batch
may be partial: its samples are shared out as any batch's, and a rank whose share of a micro-batch is empty forwards a
stand-in whose output counts in nothing, so that every rank runs as many forwards as every other (a sharded model's
forward is collective). The loss adds what one process over the same samples adds: the model's sum and its count, or
its mean times the targets the launcher counts, or, where the batch holds none it counts, times the micro-batch's
samples (one process's where the mean is per sample; said at start).

Figures: `val_loss` and `val/<metric>` for the data's one validation split; `val/<set>/loss` and
`val/<set>/<metric>` for each set `data.val` names.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.base.collectives import all_reduce
from launcher.base.durable import write_durably
from launcher.base.errors import Refused
from launcher.data.builtin import build_dataset
from launcher.data.collate import build_collate
from launcher.data.sources import source_of
from launcher.evaluation.metrics import build_metrics
from launcher.models.loss import LabelRule, model_loss, say_once, target_tokens
from strategies import RunContext, Strategy

ALL = "all"
"""trainer.eval_batches=all: every sample of each set, once."""


class Evaluation:
    """The validation sets of a run (name -> source) and, for each, its own instances of the configured metrics."""

    def __init__(self, sets: dict[str, Any], metrics: Any, batches: int | None, ctx: RunContext) -> None:
        self.sets, self.batches, self.ctx = sets, batches, ctx
        """`batches`: trainer.eval_batches, None for `all`."""
        self.device = torch.device(ctx.device)
        self.metrics = {name: {n: m.to(self.device) for n, m in build_metrics(metrics or {}).items()} for name in sets}

    def names(self, set_name: str) -> str:
        """The prefix of a set's figures."""
        return "val/" if list(self.sets) == ["val"] else f"val/{set_name}/"

    def check(self, strategy: Strategy, rule: LabelRule) -> None:
        """Before the first step, on every rank alike: what a pass reads of each set, and how its loss is weighed,
        said once (rank 0); each metric fed the first micro-batch of each set (a copy of it: nothing is counted), so
        that one that fails ends the run at once, in one line, and where its inputs were found is said at start."""
        strategy.train(False)
        with torch.no_grad():
            for name, source in self.sets.items():
                if self.ctx.rank == 0:
                    say_once(f"launch: evaluation: the set {name}: {source.evaluated(self.batches)}")
                micro = next(iter(self._pass(source, 1)), None)
                if micro is None:
                    raise Refused(f"the validation set {name} holds no sample; give it samples, or leave it out")
                batch = micro[0].batch
                output = strategy.forward(batch)  # every rank: a sharded model's forward is collective
                if self.ctx.rank == 0 and (why := unweighed(output, batch, rule)):
                    say_once(f"launch: evaluation: {why}")
                for metric_name, metric in self.metrics[name].items():
                    try:
                        copy.deepcopy(metric).update(output, batch)
                    except Exception as e:
                        why = " ".join(str(e).split())[:300]
                        raise Refused(
                            f"trainer.metrics.{metric_name} fails on the first batch of the validation set {name}: "
                            f"{type(e).__name__}: {why}"
                        ) from e
        strategy.train(True)

    def _pass(self, source: Any, batches: int | None) -> Any:
        return source.evaluation(batches, self.ctx.data_rank, self.ctx.data_world, self.ctx.accumulation, self.device)

    def run(self, strategy: Strategy, rule: LabelRule, averaged: bool = False) -> dict[str, float]:
        """One pass over every set: each one's loss and metrics, as logged figures, then each one's loss on the EMA
        weights where the run keeps them; `averaged`: the model holds its EMA weights, and the pass's figures are
        named as theirs (val_ema_loss, val/ema/<metric>)."""
        figures: dict[str, float] = {}
        for name, source in self.sets.items():
            loss, values = validate(strategy, source, self.ctx, self.batches, rule, self.metrics[name])
            prefix = self.names(name)
            figures[loss_name(prefix, averaged)] = loss
            figures |= {f"{prefix}{'ema/' if averaged else ''}{k}": v for k, v in values.items()}
            for part, alone in (source.alone() if hasattr(source, "alone") else {}).items():  # data=mix's sources
                part_loss, _ = validate(strategy, alone, self.ctx, self.batches, rule, {})
                if part_loss == part_loss:  # NaN: its split holds no sample
                    figures[f"{loss_name(prefix, averaged)}/{part}"] = part_loss
        if averaged:
            return figures
        with strategy.averaged() as ema:  # trainer.ema: each set's loss on the moving average of the weights too
            if ema:
                for name, source in self.sets.items():
                    loss, _ = validate(strategy, source, self.ctx, self.batches, rule, {})
                    figures[loss_name(self.names(name), True)] = loss
        return figures

    def once(self, strategy: Strategy, rule: LabelRule, step: int, run_dir: Path, ema: bool = False) -> bool:
        """`launch eval`: the resumed checkpoint's figures (`ema`: those of its EMA weights alone), on every rank
        alike; rank 0 prints one table and writes `<run dir>/eval.json` (the checkpoint's step and its figures)."""
        if ema:
            with strategy.averaged() as held:
                if not held:
                    raise Refused(
                        "launch eval ema=true: this run keeps no EMA weights; give the run's trainer.ema.decay"
                    )
                figures = self.run(strategy, rule, averaged=True)
        else:
            figures = self.run(strategy, rule)
        if self.ctx.rank == 0:
            write_durably(run_dir / "eval.json", json.dumps({"step": step, "figures": figures}, indent=2))
            width = max(len(name) for name in figures)
            rows = [f"{'figure':<{width}}  value", *(f"{n:<{width}}  {v:.8g}" for n, v in figures.items())]
            print("\n".join([f"launch: evaluation of step {step}", *rows, f"launch: wrote {run_dir / 'eval.json'}"]))
        return True


def loss_name(prefix: str, ema: bool) -> str:
    """The name of a set's validation loss (`prefix`: `Evaluation.names`'s), of the weights or of their average."""
    return ("val_ema_loss" if ema else "val_loss") if prefix == "val/" else f"{prefix}{'ema_' if ema else ''}loss"


def validate(
    strategy: Strategy, source: Any, ctx: RunContext, batches: int | None, rule: LabelRule, metrics: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """The loss over a validation source's first `batches` global batches (None: all of it; `source.evaluation`: the
    same samples at every evaluation and world size, each once), added as one process over them adds it (`weighed`);
    and each metric, fed every counted micro-batch's output, reduced over ranks. A stand-in (`EvalMicro`) is
    forwarded with the others and counts in nothing."""
    device = torch.device(ctx.device)
    strategy.train(False)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for micro in source.evaluation(batches, ctx.data_rank, ctx.data_world, ctx.accumulation, device):
            for batch, counted in micro:
                output = strategy.forward(batch)  # every rank as many: a sharded model's forward is collective
                if not counted:
                    continue
                loss, weight = weighed(output, batch, rule)
                total, count = total + loss, count + weight
                for metric in metrics.values():
                    metric.update(output, batch)
    strategy.train(True)
    total, count = all_reduce([total, count], dist.ReduceOp.SUM, device)
    values: dict[str, float] = {}
    for metric in metrics.values():  # in the config's order, the same on every rank: their collectives match
        values |= metric.reduce(device)
    return (total / count if count else float("nan")), values


def weighed(output: Any, batch: Any, rule: LabelRule) -> tuple[float, float]:
    """A micro-batch's (loss sum, weight), added in float64 over micro-batches and ranks, as one process over the same
    samples adds them: the model's sum and its count; or its mean times the targets the launcher counts (its labels
    by the model's rule, else `targets`, `labels` or a tuple's last integer tensor, -100 ignored); or, where the batch
    holds none it counts, its mean times the micro-batch's samples (`unweighed` says so at start)."""
    loss, tokens = model_loss(output, rule.loss_at)
    if tokens is not None:
        return float(loss), float(tokens)
    targets, _ = target_tokens(batch, rule.label_shift)
    weight = targets if targets is not None else samples_in(batch)
    return (float(loss) * weight if weight else 0.0), float(weight)  # no target: 0, not NaN


def unweighed(output: Any, batch: Any, rule: LabelRule) -> str | None:
    """Where the validation loss is one process's only if the model's mean is over what the launcher weighs it by:
    the line that says so (None where it is exact: a sum and its count, a mean over labels counted by the model's
    rule, or a mean over one target per sample)."""
    loss, tokens = model_loss(output, rule.loss_at)
    if tokens is not None:
        return None
    targets, known = target_tokens(batch, rule.label_shift)
    if known or (targets is not None and targets == samples_in(batch)):
        return None
    fix = "return (loss_sum, num_tokens) to make it exact whatever the mean is over"
    if targets is not None:
        return (
            "the model returns a mean; the validation loss weighs each micro-batch's mean by the targets counted in "
            f"it (-100 ignored), which is one process's figure where the mean is over those targets; {fix}"
        )
    return (
        "the model returns a mean and its batches hold no targets the launcher counts (labels, targets, a tuple's "
        "last integer tensor); the validation loss weighs each micro-batch's mean by its samples, which is one "
        f"process's figure where the mean is per sample; {fix}"
    )


def samples_in(batch: Any) -> int:
    """The samples in a batch: the first dimension of its first tensor (a mapping's, a tuple's, or itself), else its
    length (a torch_geometric `Batch`: its graphs), else 1."""
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple, torch.Tensor)):
        items = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    else:
        return len(batch) if hasattr(batch, "__len__") else 1
    first = next((t for t in items if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def evaluation_of(cfg: Any, ctx: RunContext) -> Evaluation:
    """The run's evaluation: the validation sets (`validation_sets`), and the metrics trainer.metrics names."""
    B = int(cfg.batch.global_size)
    sets = {
        name: source_of(build_dataset(node, "val"), B, cfg.seed, build_collate(node.get("collate")), f"the set {name}")
        for name, node in validation_sets(cfg.data).items()
    }
    batches = cfg.trainer.eval_batches
    return Evaluation(sets, cfg.trainer.get("metrics"), None if batches == ALL else int(batches), ctx)


def validation_sets(data: Any) -> dict[str, Any]:
    """name -> the data node each validation set is built from (with split="val"): each of `data.val`, a node of its
    own (`_target_`) or its keys merged over the data's; unset, the data's own validation split, named `val`."""
    from omegaconf import OmegaConf

    named = data.get("val") or {}
    if not named:
        return {"val": data}
    base = OmegaConf.masked_copy(data, [k for k in data if k != "val"])
    return {str(n): node if "_target_" in node else OmegaConf.merge(base, node) for n, node in named.items()}
