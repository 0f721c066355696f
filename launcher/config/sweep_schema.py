"""`sweep.*`: what every trial's run of a search needs to know: the objective (which logged figure, where in the run,
which way is better), the pruner, and (set by the search sweeper for each trial it runs) which trial of which study
the run is. What only the sweeper needs (sampler, budget, storage, search space) is under `hydra.sweeper.*`. Not part
of a run's identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from launcher.config.ranges import COUNT, ranged


class ObjectiveAt(Enum):
    last = "last"
    """The figure at the run's last step that logged it."""
    best = "best"
    """Its best value over the run (lowest when minimizing)."""


@dataclass
class SweepConfig:
    objective: Any = "val_loss"
    """The logged figure a search optimises (launcher/base/metrics.py declares them), or a list of them: a
    multi-objective study (`launcher.search.objective.figures` checks it)."""
    objective_at: ObjectiveAt = ObjectiveAt.last
    direction: Any = "minimize"
    """minimize or maximize; for a list of objectives, a list of as many."""
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    """The Optuna pruner each trial's rank 0 asks at every evaluation but the last (any `_target_`, e.g.
    optuna.pruners.ThresholdPruner with +sweep.pruner.upper=...); null: trials are never pruned."""
    study: str | None = None
    """Set by the search sweeper: the study this run is a trial of."""
    storage: str | None = None
    """Set by the search sweeper: the study's storage, a database URL or `journal:<file>` (rank 0 reports the objective
    there as the run goes)."""
    trial: int | None = ranged(None, COUNT)
    """Set by the search sweeper: the trial's number in its study."""
