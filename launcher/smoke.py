"""What `launch -m +sweep=smoke` runs (conf/sweep/smoke.yaml): every strategy preset this machine can run, each on
a tiny job, so that a user's CI proves their model and data under all of them in a few minutes.

Two resolvers, registered by `launcher.schema` (read by conf/sweep/smoke.yaml and conf/sweep/strategies.yaml):
- `${launch_strategies:}`: the presets in conf/strategy/ (not `auto`), less those this machine cannot run, each
  left out with a printed line saying why (ZeRO-Infinity without DeepSpeed's async I/O op, which needs libaio);
- `${launch_scratch:NAME}`: a folder of this user's under the system's temporary directory, made on first use:
  the smoke sweep's NVMe folder for ZeRO-Infinity (each rank swaps into a subfolder of its own, removed at the end).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def runnable_strategies() -> str:
    from launcher.groups import choices

    names = [n for n in choices()["strategy"] if n != "auto"]
    if "zero_infinity" in names:
        from strategies.deepspeed.strategy import async_io_problem

        problem = async_io_problem("cpu")
        if problem:
            names.remove("zero_infinity")
            print(f"launch: smoke: zero_infinity left out: {problem}", file=sys.stderr, flush=True)
    return ",".join(names)


def scratch(name: str) -> str:
    folder = Path(tempfile.gettempdir()) / f"launch-{os.getuid()}" / name
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(folder)
