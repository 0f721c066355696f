"""The learning-rate schedule: a pure function of the optimizer step (no state of its own, so a resume at any step
is exact), and its checks before start.

- cosine, linear, constant: linear warmup, then the shape over the remaining steps down to trainer.min_lr_ratio;
- wsd (warmup-stable-decay): linear warmup, optim.lr until the last trainer.decay_steps (or trainer.decay_fraction
  of trainer.max_steps), then down to trainer.min_lr_ratio in trainer.decay_shape (linear, sqrt: 1 - sqrt(progress),
  cosine), reaching it at the last step;
- inverse_sqrt: linear warmup, then optim.lr x sqrt(warmup / (step + 1));
- custom: trainer.schedule_fn, a function of the 0-based step and max_steps (by `_target_`, with its own keys)
  returning the fraction of optim.lr; it owns warmup too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1 - math.sqrt(p),
}
"""How a decay goes from 1 (progress 0) to 0 (progress 1)."""


def lr_at(
    step: int,
    base: float,
    warmup: int,
    max_steps: int,
    schedule: str,
    min_ratio: float,
    decay_steps: int = 0,
    shape: str = "linear",
    fn: Callable[..., float] | None = None,
) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warmup, then the chosen schedule (module docstring).
    `decay_steps`: wsd's decay phase; `fn`: custom's function of (step, max_steps)."""
    if schedule == "custom":
        assert fn is not None, "schedule=custom needs its function"
        return base * float(fn(step, max_steps))
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    if schedule == "inverse_sqrt":
        return base * math.sqrt(max(1, warmup) / (step + 1))
    if schedule == "wsd":
        start = max_steps - decay_steps
        if step < start:
            return base
        progress = min(1.0, (step - start + 1) / decay_steps)
        return base * (min_ratio + (1 - min_ratio) * SHAPES[shape](progress))
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup - 1))
    return base * (min_ratio + (1 - min_ratio) * SHAPES["cosine" if schedule == "cosine" else "linear"](progress))


def decay_steps(trainer: Any, max_steps: int) -> int:
    """wsd's decay phase in steps: trainer.decay_steps, or trainer.decay_fraction of max_steps (at least 1)."""
    given = trainer.get("decay_steps")
    return int(given) if given is not None else max(1, round(float(trainer.get("decay_fraction", 0.2)) * max_steps))


@functools.cache
def _function(target: str, keys: tuple[tuple[str, Any], ...]) -> Callable[..., float]:
    from hydra.utils import instantiate

    return instantiate({"_target_": target, **dict(keys)}, _partial_=True)


def schedule_function(trainer: Any) -> Callable[..., float] | None:
    """trainer.schedule_fn as a function of (step, max_steps); None unless trainer.schedule=custom."""
    if str(trainer.get("schedule")) != "custom":
        return None
    node = dict(trainer.get("schedule_fn") or {})
    target = node.pop("_target_", None)
    if target is None:
        raise ValueError("trainer.schedule=custom needs trainer.schedule_fn={_target_: your.module.function}")
    return _function(str(target), tuple(sorted(node.items())))


def schedule_lr(trainer: Any, base: float, step: int, max_steps: int) -> float:
    """The run's learning rate at 0-based step `step`, as the config's trainer.* keys give it."""
    schedule = str(trainer.schedule)
    decay = decay_steps(trainer, max_steps) if schedule == "wsd" else 0
    shape = str(trainer.get("decay_shape", "linear"))
    return lr_at(
        step,
        base,
        int(trainer.warmup_steps),
        max_steps,
        schedule,
        float(trainer.min_lr_ratio),
        decay,
        shape,
        schedule_function(trainer),
    )


def check_schedule(trainer: Any) -> None:
    """Raise ValueError (one line: the values and the fix) for phases that do not fit trainer.max_steps, or a
    schedule function that does not import or does not give a fraction >= 0 at the first, middle and last step."""
    max_steps, warmup, schedule = int(trainer.max_steps), int(trainer.warmup_steps), str(trainer.schedule)
    if schedule == "wsd":
        decay = decay_steps(trainer, max_steps)
        given = (
            f"trainer.decay_steps={decay}"
            if trainer.get("decay_steps") is not None
            else f"trainer.decay_fraction={trainer.get('decay_fraction')} ({decay} steps)"
        )
        if warmup + decay > max_steps:
            raise ValueError(
                f"trainer.schedule=wsd: trainer.warmup_steps={warmup} + {given} exceed trainer.max_steps={max_steps}; "
                "shorten the warmup or the decay, or raise trainer.max_steps"
            )
    if schedule != "custom":
        return
    try:
        fn = schedule_function(trainer)
        values = [fn(s, max_steps) for s in (0, max_steps // 2, max_steps - 1)]  # type: ignore[misc]
    except ValueError:
        raise
    except Exception as e:
        target = (trainer.get("schedule_fn") or {}).get("_target_")
        raise ValueError(
            f"trainer.schedule_fn._target_={target}: {type(e).__name__}: {e}; give a function of (step, max_steps) "
            "returning the fraction of optim.lr"
        ) from e
    bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(
            f"trainer.schedule_fn gave {bad[0]!r} at a step; it must return a finite fraction of optim.lr >= 0"
        )
