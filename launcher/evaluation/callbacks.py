"""The user's callbacks and the early stop, at the trainer's named phases.

A callback (`trainer.callbacks`: a list of `_target_`s) is an object with any of `on_train_start`, `on_step_end`,
`on_eval_end`, `on_save` and `on_train_end`, each called with `(step, figures)`: the step's logged figures (reduced
over ranks: the same on every rank), the evaluation's alone for `on_eval_end`, the newest for the others (`on_save`:
once the step's save is written, or under trainer.async_checkpoint started). It runs on rank 0, or on every rank
where its class sets `every_rank = True`. A callback that raises stops the run: every rank learns of it in the
step's agreement, any save in flight is finished (so the newest complete checkpoint stays the last), and the run
ends with one line naming it.

The early stop (`trainer.early_stop`) watches one figure: each time it is logged it improves (by more than
min_delta, in its direction) or it does not; after `patience` times in a row without, every rank stops at the same
step (the agreement's all-reduce). Each improvement is saved and named `best` beside `latest`, and kept whatever
trainer.keep_last says.

The built-in logging, early stop and save policy are not callbacks: each takes part in the step's collectives (the
figures' reduction, the agreement, the save), in an order every rank must keep, which a callback (rank 0's, free to
be slow or to raise) must not be able to change. They call the same phases, and a callback sees what they decided.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from launcher.base.errors import Refused

HOOKS = ("on_train_start", "on_step_end", "on_eval_end", "on_save", "on_train_end")


class EarlyStop:
    """trainer.early_stop's state: the best value, its step, and the evaluations since."""

    def __init__(self, metric: str | None, mode: str, patience: int, min_delta: float) -> None:
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best: float | None = None
        self.best_step, self.waited = 0, 0

    def see(self, step: int, figures: dict[str, float]) -> tuple[bool, bool]:
        """(improved, stop) after a logged step's figures; (False, False) where the figure is not among them."""
        if self.metric is None or self.metric not in figures:
            return False, False
        value, best = float(figures[self.metric]), self.best
        better = best is None or (
            value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta
        )
        if better:
            self.best, self.best_step, self.waited = value, step, 0
            return True, False
        self.waited += 1
        return False, self.waited >= self.patience

    def why(self, step: int) -> str:
        return (
            f"launch: early stop after step {step}: {self.metric} did not improve by more than {self.min_delta:g} "
            f"({self.mode}) in {self.patience} evaluation(s); best {self.best:.6g} at step {self.best_step}"
        )


class Watch:
    """The callbacks and the early stop of one rank, and what every rank agreed of them at the step's end."""

    def __init__(self, callbacks: list[Any], early: EarlyStop, rank: int) -> None:
        self.callbacks = [c for c in callbacks if rank == 0 or getattr(c, "every_rank", False)]
        self.early, self.rank = early, rank
        self.failure: str | None = None
        self.flags = [0.0, 0.0, 0.0]
        """This rank's (improved, stop, a callback raised) since the last agreement."""
        self.improved = self.stop = self.failed = False
        """What every rank agreed (`agreed`)."""

    @classmethod
    def of(cls, cfg: Any, rank: int) -> Watch:
        from hydra.utils import instantiate

        made = []
        for i, node in enumerate(cfg.trainer.get("callbacks") or []):
            try:
                made.append(instantiate(node))
            except Exception as e:
                raise Refused(f"trainer.callbacks[{i}] does not build ({type(e).__name__}: {e}); fix it") from e
        stop = cfg.trainer.early_stop
        early = EarlyStop(stop.metric, str(stop.mode), int(stop.patience), float(stop.min_delta))
        return cls(made, early, rank)

    def call(self, hook: str, step: int, figures: dict[str, float]) -> None:
        """Each callback's `hook`; the first that raises is remembered, and the run stops at the agreement."""
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if fn is None or self.failure is not None:
                continue
            try:
                fn(step, dict(figures))
            except Exception as e:
                message = " ".join(str(e).split())[:300]
                name = f"{type(callback).__module__}.{type(callback).__qualname__}"
                self.failure = f"the callback {name} raised in {hook} at step {step}: {type(e).__name__}: {message}"
                self.flags[2] = 1.0

    def logged(self, step: int, figures: dict[str, float], evaluated: bool) -> None:
        """After a logged step: the early stop's judgement, then the callbacks."""
        improved, stop = self.early.see(step, figures)
        self.flags[0], self.flags[1] = max(self.flags[0], float(improved)), max(self.flags[1], float(stop))
        self.call("on_step_end", step, figures)
        if evaluated:
            self.call("on_eval_end", step, {k: v for k, v in figures.items() if k.startswith("val")})

    def agreed(self, flags: list[float]) -> None:
        """What every rank agreed (the all-reduce's maxima of `flags`)."""
        self.improved, self.stop, self.failed = (bool(f) for f in flags)
        self.flags = [0.0, 0.0, 0.0]

    @property
    def saves(self) -> bool:
        """The early stop asks for a save of this step: its best so far, or its last."""
        return self.improved or self.stop

    def marks(self, step: int) -> dict[str, Any]:
        """What a save's manifest records of the early stop: the best step so far (named `best`), the step it ended
        the run at, and why (a resume says so)."""
        return {"best": True} if self.improved else {"early_stop": self.early.why(step)} if self.stop else {}

    def settle(self, device: Any, last: Any) -> None:
        """Every rank, at the run's end: a callback that raised since the last agreement (in on_save after the last
        step, in on_train_end) ends the run as one that raised during it."""
        import torch

        raised = torch.tensor([self.flags[2]], device=device)
        dist.all_reduce(raised, op=dist.ReduceOp.MAX)
        if raised.item():
            self.fail(last)

    def fail(self, last: Any) -> None:
        """Every rank: the run ends with the raising callback's line (the lowest rank's that raised)."""
        lines: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(lines, self.failure)
        line = next(x for x in lines if x is not None)
        raise Refused(f"{line}; the newest complete checkpoint is {last or 'none (none was saved)'}")
