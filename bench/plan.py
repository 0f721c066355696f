"""`launch plan` against the import of torch it cannot avoid: the ratio of their wall times.

python bench/plan.py [--repeats 5]

`launch plan model=gpt_7b gpus=8` builds the model on the meta device and prints the table; it should cost a small
multiple of `python -c "import torch"` (about 3x on a quiet machine). Runs alternate, so load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAUNCH = str(Path(sys.executable).parent / "launch")


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    imports, plans = [], []
    for _ in range(args.repeats):
        imports.append(wall([sys.executable, "-c", "import torch"]))
        plans.append(wall([LAUNCH, "plan", "model=gpt_7b", "gpus=8"]))
    torch_s, plan_s = statistics.median(imports), statistics.median(plans)
    print(
        f"import torch {torch_s:.2f} s, launch plan {plan_s:.2f} s (medians of {args.repeats}): {plan_s / torch_s:.2f}x"
    )


if __name__ == "__main__":
    main()
