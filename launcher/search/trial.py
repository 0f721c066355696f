"""In a trial's run: rank 0 reports the objective to its trial, through the study's storage, at each step that logs
it, and asks the pruner whether to go on. The ranks agree on a stop in the runner's `agree` phase (one all-reduce,
already there for stop signals), so every rank stops after the same step, with a checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

PRUNED = "pruned.json"
"""In a pruned trial's run directory: the step it stopped after and the value the pruner judged."""


class TrialReport:
    """Rank 0 of a trial's run talks to the study; every other run and rank does nothing here."""

    def __init__(self, cfg: DictConfig, rank: int) -> None:
        sweep = OmegaConf.select(cfg, "sweep", default=None)
        self.active = rank == 0 and sweep is not None and sweep.get("trial") is not None and bool(sweep.storage)
        self.active = self.active and isinstance(sweep.objective, str)  # several objectives: Optuna prunes none
        self.sweep = sweep
        self._trial: Any = None

    def report(self, step: int, metrics: dict[str, float], last: bool) -> bool:
        """Report this step's objective, if it logged it; True when the pruner says to stop here (never at the last
        step: the trial has finished then, and its value stands)."""
        name = str(self.sweep.objective) if self.active else ""
        value = metrics.get(name)
        if not self.active or value is None or not math.isfinite(value):
            return False
        trial = self.trial()
        trial.report(float(value), step)
        return not last and trial.should_prune()

    def trial(self) -> Any:
        if self._trial is None:
            import optuna
            from hydra.utils import instantiate

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            pruner = instantiate(self.sweep.pruner) if self.sweep.pruner is not None else optuna.pruners.NopPruner()
            from launcher.search.study import storage

            spelled = storage(str(self.sweep.storage))
            study = optuna.load_study(study_name=str(self.sweep.study), storage=spelled, pruner=pruner)
            number = int(self.sweep.trial)
            (frozen,) = [t for t in study.get_trials(deepcopy=False) if t.number == number]
            self._trial = optuna.trial.Trial(study, frozen._trial_id)
        return self._trial


def record_pruned(run_dir: Path, step: int, name: str, value: float) -> None:
    (run_dir / PRUNED).write_text(json.dumps({"step": step, "objective": name, "value": value}))


def read_pruned(run_dir: Path) -> dict[str, Any] | None:
    """The pruned record, as data; None when the run was not pruned (or the file is not a record)."""
    try:
        record = json.loads((run_dir / PRUNED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
