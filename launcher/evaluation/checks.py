"""The evaluation's checks before start: every metric trainer.metrics names imports and builds (the worker builds
them the same way, `launcher.evaluation.metrics`), no metric takes the loss's name, and trainer.early_stop watches a
figure the run logs, and ema=true evaluates EMA weights the run kept (its trainer.ema.decay given). `launch eval`'s
command line is `launcher.parent.eval_command`'s."""

from __future__ import annotations

from typing import Any

from launcher.base.errors import ConfigError


def check_evaluation(frozen: Any) -> None:
    """One line (ConfigError) for the first bad value."""
    if frozen.trainer.get("eval_ema") and frozen.trainer.ema.get("decay") is None:
        raise ConfigError(
            "launch eval ema=true evaluates the EMA weights the run kept: give the run's trainer.ema.decay "
            "with its other overrides"
        )
    metrics = frozen.trainer.get("metrics") or {}
    if "loss" in metrics:
        raise ConfigError("trainer.metrics.loss: `loss` is the validation loss's name (val/<set>/loss); rename it")
    if metrics:
        from launcher.evaluation.metrics import build_metrics

        build_metrics(metrics)
    watched = frozen.trainer.early_stop.get("metric")
    if watched is None:
        return
    from launcher.base.metrics import logged_figures

    logged = logged_figures(frozen)
    if watched not in logged and not any(watched.startswith(f"{name}/") for name in logged):
        raise ConfigError(
            f"trainer.early_stop.metric={watched} is no figure this run logs; it logs: {', '.join(sorted(logged))}"
        )
