"""What `launch -m +sweep=smoke` runs (conf/sweep/smoke.yaml): every strategy preset this machine can run, each on
a tiny job, so that a user's CI proves their model and data under all of them in a few minutes.

Two resolvers, registered by `launcher.config.schema` (read by conf/sweep/smoke.yaml and conf/sweep/strategies.yaml):
- `${launch_strategies:}`: the presets in conf/strategy/ (not `auto`), less those this machine cannot run, each
  left out with a printed line saying why, by what each declares it needs (ZeRO-Infinity: DeepSpeed's async I/O op,
  which needs libaio);
- `${launch_scratch:NAME}`: a folder of this user's under the system's temporary directory, made on first use:
  the smoke sweep's NVMe folder for ZeRO-Infinity (each rank swaps into a subfolder of its own, removed at the end).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def runnable_strategies() -> str:
    """The presets of conf/strategy/ this machine can run, as each declares what it needs (`Strategy.requirements`);
    a line for each one left out, saying why."""
    from launcher.config.context import preset_strategies
    from launcher.config.groups import choices

    names = [n for n in choices()["strategy"] if n != "auto"]
    kept = []
    for name, strategy in preset_strategies(names).items():
        problem = unmet(strategy.requirements(), "cpu")
        if strategy.requirements().model_plan:  # not every model has a plan: run it by name (strategy=fsdp_tp)
            problem = "it splits layers by the model's tensor-parallel plan, which not every model has; run it alone"
        if problem:
            print(f"launch: smoke: {name} left out: {problem}", file=sys.stderr, flush=True)
        else:
            kept.append(name)
    return ",".join(kept)


def scratch(name: str) -> str:
    folder = Path(tempfile.gettempdir()) / f"launch-{os.getuid()}" / name
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(folder)


def unmet(requirements: Any, device_type: str) -> str | None:
    """Why this machine cannot give a strategy what it `requirements` says it needs, in a line; None if it can."""
    if device_type not in requirements.devices:
        return f"it runs on {' or '.join(requirements.devices)} only"
    for op in requirements.ops:
        from strategies.deepspeed.ops import op_problem  # DeepSpeed's op builders: only for its strategies

        problem = op_problem(op, device_type)
        if problem:
            return problem
    return None
