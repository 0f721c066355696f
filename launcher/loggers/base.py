"""Metric loggers and the progress line. Only rank 0 logs; other ranks get NullLogger.

A logger is any `_target_` with `log(metrics, step)` and `finish()` (or `finish(status)`, to hear how the run ended:
FINISHED, FAILED or KILLED, a stop signal); it is constructed with its own config keys plus `run_config` (the resolved
run config as a dict) and `run_dir`. `run_config["job"]["run_id"]` is the job's one run id, kept across restarts,
requeues and `resume=` of its run directory, and `run_config["job"]["continues"]` the run a `resume=` into a new run
directory continues (`launcher.parent.run_id`); `last_logged_step(run_dir / "metrics.jsonl")` is where an earlier
attempt of the run stopped logging. Several loggers at once (`logger=[wandb,mlflow]`): each gets every figure at every
step metrics.jsonl gets, in the order they are named.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class NullLogger:
    def __init__(self, **_: Any) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class JsonlLogger:
    """metrics.jsonl in the run directory: always written by rank 0, read by tests and sweep reports."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Strict JSON: a NaN or Inf figure is null (json.dumps would write the bare NaN that strict readers refuse).
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **record}, allow_nan=False) + "\n")

    def finish(self) -> None:
        self.file.close()


def last_logged_step(path: Path) -> int:
    """The highest step metrics.jsonl at `path` holds (0: none), for a logger that must not log a step twice.

    Each attempt of a run appends from the step it resumed at, so the file is increasing stretches, one per attempt,
    and its highest step need not be its last (an attempt killed before it passed the one before): the whole file is
    read once, when the logger starts (about a second a million steps). A torn last line (a kill mid-write) is
    skipped: that step reached no logger, which are written after metrics.jsonl (`Loggers.log`)."""
    highest = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b'{"step": ') and line.endswith(b"\n"):
                    step = line[len(b'{"step": ') :].split(b",", 1)[0]
                    if step.isdigit():
                        highest = max(highest, int(step))
    except FileNotFoundError:
        pass
    return highest


FINISH_GRACE = 3.0
"""Seconds a failing rank 0 gives its loggers to finish (`finish_failed`) before it exits anyway."""
_OPEN: list[Loggers] = []
"""This process's loggers not finished yet."""


def finish_failed() -> None:
    """A failing rank 0, just before it exits (`launcher.worker.lifecycle.report_failure`): its loggers finish as
    FAILED, so what the attempt logged reaches them (offline, wandb writes its file 32 KiB at a time: a short attempt's
    whole history) and the next attempt resumes a run that says it failed. In a thread, for at most `FINISH_GRACE`
    seconds: a logger that hangs (its server gone) does not hold the failure up."""
    import threading

    def finish() -> None:
        for loggers in list(_OPEN):
            try:
                loggers.finish("FAILED")
            except Exception:  # the run is lost either way; the failure being reported is what matters
                pass

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    thread.join(FINISH_GRACE)


def finish(logger: Any, status: str) -> None:
    """`logger.finish(status)` where its finish takes a status, else `logger.finish()` (a logger of the plain
    contract)."""
    import inspect

    try:
        parameters = inspect.signature(logger.finish).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the plain contract
        parameters = []  # type: ignore[assignment]
    if any(p.name == "status" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters):
        logger.finish(status)
    else:
        logger.finish()


HIDDEN = "<hidden>"
"""What the loggers get in place of a secret of the run config (`rdzv.secret`)."""


def run_config(cfg: Any) -> dict[str, Any]:
    """The resolved run config as the loggers get it (a dict): rdzv.secret, the token that guards the rendezvous of a
    job submitted to SLURM, hidden."""
    from omegaconf import OmegaConf

    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    if isinstance(config.get("rdzv"), dict) and config["rdzv"].get("secret"):
        config["rdzv"]["secret"] = HIDDEN
    return config


@dataclass(eq=False)
class Loggers:
    """Rank 0 writes metrics.jsonl and every configured logger; the other ranks write nothing."""

    rank: int
    jsonl: Any
    external: list[Any] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: Any, rank: int, run_dir: Path) -> Loggers:
        from hydra.utils import instantiate

        from launcher.config import target_nodes

        if rank != 0:
            return cls(rank, NullLogger())
        config = run_config(cfg)
        loggers = cls(rank, JsonlLogger(run_dir / "metrics.jsonl"))
        _OPEN.append(loggers)
        try:
            for _, node in target_nodes(cfg, "logger"):
                built = instantiate(node, _partial_=True, _convert_="all")(run_config=config, run_dir=str(run_dir))
                loggers.external.append(built)
        except BaseException:
            loggers.finish("FAILED")  # the ones already started say the run failed
            raise
        return loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.jsonl.log(metrics, step)
        for logger in self.external:
            logger.log(metrics, step)

    def finish(self, status: str = "FINISHED") -> None:
        """Every logger finishes, even after one that fails to (its error is raised once all have)."""
        if self in _OPEN:
            _OPEN.remove(self)
        self.jsonl.finish()
        errors = []
        for logger in self.external:
            try:
                finish(logger, status)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
