"""A trial's objective, read from the figures its run logged (`metrics.jsonl`): `sweep.objective` at the run's last
step that logged it, or its best over the run (`sweep.objective_at`).

A run started again in its own folder (a study continued after a kill) appends to the same file, replaying the
steps after its checkpoint: only the records the run's final state descends from count (`lineage`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def lineage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run as it ended: a step logged again replaces that step and every later one."""
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """`metrics.jsonl` as data (parsed, never run); a line cut short by a kill is left out."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return lineage(records)


def objective(records: list[dict[str, Any]], name: str, at: str, direction: str) -> tuple[float | None, str]:
    """The objective and, where there is none, why (one line): never logged, or not finite."""
    values = [(r["step"], r[name]) for r in records if name in r]
    if not values:
        return None, f"the run logged no {name}"
    step, value = values[-1]
    if at == "best":
        finite = [(s, v) for s, v in values if _finite(v)]
        if finite:
            pick = min if direction == "minimize" else max
            step, value = pick(finite, key=lambda sv: sv[1])
    if not _finite(value):
        return None, f"{name} at step {step} is not finite"
    return float(value), ""


class ObjectiveError(ValueError):
    """`sweep.objective` and `sweep.direction` that do not say what to optimise: one line naming them and the fix."""


def figures(sweep: dict[str, Any]) -> list[tuple[str, str]]:
    """The study's objectives, each with its direction: one figure (a string), or a list of figures with a list of
    as many directions (a multi-objective study); ObjectiveError otherwise."""
    names, directions = sweep["objective"], sweep["direction"]
    several = isinstance(names, list)
    names = names if several else [names]
    directions = directions if isinstance(directions, list) else [directions] * (1 if not several else 0)
    shown = f"sweep.objective={sweep['objective']} sweep.direction={sweep['direction']}".replace("'", "")
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
        raise ObjectiveError(f"{shown}: the objectives must be distinct figure names, e.g. [val_loss,tokens_per_s]")
    if several and len(names) < 2:
        raise ObjectiveError(f"{shown}: a list is for several objectives; give one as sweep.objective=NAME")
    if len(directions) != len(names):
        raise ObjectiveError(
            f"{shown}: give one direction per objective, e.g. sweep.direction=[minimize,maximize] for "
            f"{len(names)} objectives"
        )
    if bad := [d for d in directions if d not in ("minimize", "maximize")]:
        raise ObjectiveError(f"{shown}: a direction is minimize or maximize, not {bad[0]}")
    return list(zip(names, directions))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trial_outcome(cfg: Any, run_dir: Path, code: int, reason: str) -> dict[str, Any]:
    """A search trial's outcome, for the sweeper (the task function returns it) and the report (`outcome.json`):
    its state (complete, pruned, failed, stopped by a signal) and objective; {} for a run that is no trial."""
    from omegaconf import OmegaConf

    from launcher.search.trial import read_pruned

    sweep = OmegaConf.to_container(cfg.sweep, resolve=True, enum_to_str=True) if "sweep" in cfg else {}
    if not isinstance(sweep, dict) or sweep.get("trial") is None:
        return {}
    record: dict[str, Any] = {
        "trial": sweep["trial"],
        "objective_name": sweep["objective"],
        "objective": None,
        "direction": sweep["direction"],
    }
    if code >= 128:
        return record | {"state": "stopped"}  # a stop signal: the trial goes on when the study is continued
    if code:
        return record | {"state": "failed", "reason": reason}
    if isinstance(sweep["objective"], list):  # several objectives: each at the run's last step that logged it
        records = read_metrics(run_dir)
        found = [objective(records, name, "last", direction) for name, direction in figures(sweep)]
        if whys := [why for value, why in found if value is None]:
            return record | {"state": "failed", "reason": f"no objective: {'; '.join(whys)}"}
        return record | {"state": "complete", "objective": [value for value, _ in found]}
    value, why = objective(read_metrics(run_dir), sweep["objective"], sweep["objective_at"], sweep["direction"])
    pruned = read_pruned(run_dir)
    if pruned is not None:
        return record | {"state": "pruned", "objective": value, "pruned_at": pruned["step"]}
    if value is None:
        return record | {"state": "failed", "reason": f"no objective: {why}"}
    return record | {"state": "complete", "objective": value}
