"""Every logged figure, declared once: its name, unit, how it is reduced over ranks, and who reports it.

The runner reduces each figure by its declaration (`over_ranks`) and refuses a name that is not declared here, so a
strategy cannot add a figure whose meaning over ranks nobody chose; `metrics.jsonl`, the loggers and the sweep
report read the same names, and the README's Logging section lists each of them (a test holds it to this table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Reduction = Literal["sum", "max", "argmax", "same", "rank0"]
"""sum: each rank's part added; max: the largest rank's; argmax: which rank that is (the lowest of equal ones); same:
equal on every rank (rank 0's is logged); rank0: rank 0's own measurement."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    """bytes, s, 1/s, or "" (a plain number)."""
    reduction: Reduction
    by: str
    """Who reports it: the runner, the strategy, the evaluation, the planner, the guard, the saver."""
    doc: str


METRICS = {
    m.name: m
    for m in (
        Metric("loss", "", "sum", "runner", "the loss of the whole global batch (each rank's part, summed)"),
        Metric("val_loss", "", "sum", "evaluation", "the validation loss: Σ token losses / Σ targets over all ranks"),
        Metric("val_ema_loss", "", "sum", "evaluation", "the same, of the EMA weights (trainer.ema.decay)"),
        Metric("lr", "", "same", "runner", "the step's learning rate"),
        Metric("grad_norm", "", "same", "strategy", "the global gradient norm, before clipping"),
        Metric("accumulation", "", "same", "runner", "micro-steps per optimizer step"),
        Metric("micro_size", "", "same", "runner", "samples per rank per forward pass (batch.micro_size=auto: adapts)"),
        Metric("world_size", "", "same", "runner", "ranks of the worker group"),
        Metric("restart", "", "same", "runner", "the attempt of the worker group that logged the step (0: the first)"),
        Metric(
            "step_time_s", "s", "rank0", "runner", "from the wait for the step's batches to its optimizer step's end"
        ),
        Metric("samples_per_s", "1/s", "rank0", "runner", "global batch samples per second"),
        Metric("tokens_per_s", "1/s", "sum", "runner", "every rank's tokens over rank 0's seconds (token-id batches)"),
        Metric("mfu", "", "rank0", "runner", "model FLOPs utilisation, where the device's peak is known"),
        Metric("rss_bytes", "bytes", "max", "runner", "the process's peak resident set"),
        Metric(
            "peak_memory_bytes", "bytes", "max", "runner", "the step's peak of what is really allocated (CPU: tensors)"
        ),
        Metric(
            "heap_other_bytes",
            "bytes",
            "max",
            "runner",
            "CPU: what the C heap holds beyond tensors at a measured step's end (the libraries' workspaces)",
        ),
        Metric("setup_peak_bytes", "bytes", "max", "runner", "the peak while the strategy built and wrapped the model"),
        Metric("checkpoint_stall_s", "s", "max", "saver", "seconds a save blocked the loop since the last log"),
        Metric("skipped_steps", "", "same", "guard", "steps not applied, not being finite (trainer.nonfinite=skip)"),
        Metric("comm_bytes_formula", "bytes", "same", "planner", "the planner's bytes a rank sends per optimizer step"),
        Metric("plan_peak_bytes", "bytes", "same", "planner", "the planner's peak per rank for this run"),
        Metric(
            "model_state_bytes", "bytes", "max", "strategy", "parameters + gradients + optimizer state on the device"
        ),
        Metric("offloaded_state_bytes", "bytes", "max", "strategy", "the same, held in host memory or on NVMe"),
        Metric("comm_calls", "", "max", "strategy", "gradient-synchronisation collectives of the last step"),
        Metric("comm_bytes", "bytes", "max", "strategy", "their payload"),
        Metric("comm_sent_bytes", "bytes", "max", "strategy", "the ring bytes a rank sent in the last step"),
        Metric("tp_comm_calls", "", "max", "strategy", "tensor parallel: activation collectives of the last step"),
        Metric("tp_comm_bytes", "bytes", "max", "strategy", "their payload"),
        Metric("tp_comm_sent_bytes", "bytes", "max", "strategy", "the ring bytes a rank sent in them"),
        Metric(
            "pp_sent_bytes",
            "bytes",
            "max",
            "strategy",
            "pipeline parallel: the activations and their gradients a rank sent to other stages in the last step",
        ),
        Metric("loss_scale", "", "max", "strategy", "precision=fp16: the loss scaler's scale after the step"),
        Metric(
            "compute_s_max",
            "s",
            "max",
            "runner",
            "a rank's seconds in the step out of its timed collectives (`launcher.telemetry.stragglers`), the most",
        ),
        Metric("compute_s_rank", "", "argmax", "runner", "the rank that computed that long"),
        Metric(
            "wait_s_max", "s", "max", "runner", "a rank's seconds waiting in the step's timed collectives, the most"
        ),
        Metric("wait_s_rank", "", "argmax", "runner", "the rank that waited that long"),
        Metric("loss/<source>", "", "sum", "runner", "data=mix: the loss of a source's samples of the step (logits)"),
        Metric("tokens/<source>", "", "sum", "runner", "data=mix: the input tokens of a source's samples so far"),
        Metric("val_loss/<source>", "", "sum", "evaluation", "data=mix: a source's validation loss, alone"),
        Metric("samples/<source>", "", "same", "data", "data=mix: the samples a source gave so far (its position)"),
        Metric("fraction/<source>", "", "same", "data", "data=mix: its share of every sample trained on so far"),
        Metric("epochs/<source>", "", "same", "data", "data=mix: a map-style source's epochs begun"),
    )
}


EVALUATED = Metric(
    "val/<metric>, val/<set>/loss, val/<set>/<metric>",
    "",
    "same",
    "evaluation",
    "a validation figure of trainer.metrics or of a set data.val names: reduced over ranks exactly by the evaluation "
    "(`launcher.evaluation.metrics`), the same on every rank",
)
"""The declaration of every figure the evaluation names after the user's metrics and validation sets."""


def declared(name: str) -> Metric:
    """The declaration of `name`; KeyError (one line) for a figure nobody declared."""
    if name.startswith("val/"):
        return EVALUATED
    try:
        return METRICS[name] if name in METRICS else METRICS[name.split("/", 1)[0] + "/<source>"]
    except KeyError:
        raise KeyError(
            f"the figure {name!r} has no declaration in launcher/base/metrics.py: declare its unit and its reduction "
            "over ranks there"
        ) from None


REDUCERS: dict[Reduction, Callable[[Sequence[float]], float]] = {
    "sum": sum,
    "max": max,
    "argmax": lambda column: column.index(max(column)),
}
"""The reductions that take a collective; the others are this rank's value as it is. A column is in rank order,
the same on every rank, so every rank reduces it to the same value."""


def over_ranks(
    figures: dict[str, float],
    gather: Callable[[list[float]], list[list[float]]],
    sums: Sequence[float] = (),
    each: Sequence[float] = (),
) -> tuple[dict[str, float], list[float], list[list[float]]]:
    """This rank's `figures`, reduced over ranks by each one's declaration, in one collective (`gather`: every rank's
    values, a row per rank, in rank order; every rank passes the same names, in the same order). Figures that are
    the same on every rank, or rank 0's own, are returned as they are. `sums`: values that are no figure (a count the
    figures are computed from), summed over ranks in the same collective and returned beside them; `each`: values
    returned as every rank's, a row per rank (what `launcher.telemetry.stragglers` compares ranks by)."""
    out = dict(figures)
    names = [name for name in figures if declared(name).reduction in REDUCERS]
    if not names and not sums and not each:
        return out, [], []
    rows = gather([*(figures[name] for name in names), *sums, *each])
    columns = list(zip(*rows, strict=True))
    for name, column in zip(names, columns):
        out[name] = REDUCERS[declared(name).reduction](column)
    summed = [sum(column) for column in columns[len(names) : len(names) + len(sums)]]
    return out, summed, [row[len(row) - len(each) :] for row in rows] if each else []


def table() -> str:
    """The README's table of logged figures, from the declarations (`python -m launcher.base.metrics` prints it)."""
    lines = ["| figure | unit | over ranks | reported by | what it is |", "|---|---|---|---|---|"]
    for m in METRICS.values():
        lines.append(f"| `{m.name}` | {m.unit or '—'} | {m.reduction} | {m.by} | {m.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())


def logged_figures(frozen: Any) -> set[str]:
    """The figures a run of the frozen config `frozen` logs, by name: the declared ones, and the evaluation's where it
    evaluates (`val_loss`, or `val/<set>/loss` for each of data.val; `val/<metric>` or `val/<set>/<metric>`); a
    mixture's per-source figures are `<figure>/<source>` of these (early stop and a sweep's objective take them by
    prefix)."""
    names = set(METRICS) - {"val_loss"}
    if int(frozen.trainer.eval_every) <= 0:
        return names
    sets = [str(n) for n in (frozen.data.get("val") or {})]
    prefixes = [f"val/{n}/" for n in sets] or ["val/"]
    names |= {f"{p}loss" for p in prefixes} if sets else {"val_loss"}
    return names | {f"{p}{m}" for p in prefixes for m in frozen.trainer.get("metrics") or {}}
