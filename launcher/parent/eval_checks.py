"""The evaluation's checks before start: every metric trainer.metrics names imports and builds (the worker builds
them the same way, `launcher.worker.eval_metrics`), no metric takes the loss's name, and trainer.early_stop watches a
figure the run logs."""

from __future__ import annotations

from typing import Any

from launcher.base.errors import ConfigError


def check_evaluation(frozen: Any) -> None:
    """One line (ConfigError) for the first bad value."""
    metrics = frozen.trainer.get("metrics") or {}
    if "loss" in metrics:
        raise ConfigError("trainer.metrics.loss: `loss` is the validation loss's name (val/<set>/loss); rename it")
    if metrics:
        from launcher.worker.eval_metrics import build_metrics

        build_metrics(metrics)
    watched = frozen.trainer.early_stop.get("metric")
    if watched is None:
        return
    logged = figures(frozen)
    if watched not in logged and not any(watched.startswith(f"{name}/") for name in logged):
        raise ConfigError(
            f"trainer.early_stop.metric={watched} is no figure this run logs; it logs: {', '.join(sorted(logged))}"
        )


def figures(frozen: Any) -> set[str]:
    """The figures the run logs by name: the declared ones, and the evaluation's where it evaluates."""
    from launcher.base.metrics import METRICS

    names = set(METRICS) - {"val_loss"}
    if int(frozen.trainer.eval_every) <= 0:
        return names
    sets = [str(n) for n in (frozen.data.get("val") or {})]
    prefixes = [f"val/{n}/" for n in sets] or ["val/"]
    names |= {f"{p}loss" for p in prefixes} if sets else {"val_loss"}
    return names | {f"{p}{m}" for p in prefixes for m in frozen.trainer.get("metrics") or {}}
