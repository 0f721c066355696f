"""bench/scale.py --faults: one fault among 32 one-rank nodes, three times, and what every node's terminal said."""

from __future__ import annotations

import time
from pathlib import Path

from scale_job import GLOBAL, Job, free_port

FAULTS = {
    "a rank that fails at its first step": [
        "model._target_=faulty.RaisingGPT",
        "+model.bad_rank=20",
        "+model.at_call=1",
    ],
    "a rank that hangs": ["model._target_=faulty.HangingGPT", "+model.bad_rank=20", "+model.at_call=3"],
    "a node whose run directory is its own": [],
}


def faults(nodes: int, out: Path) -> int:
    """One fault among `nodes` one-rank nodes, for each of FAULTS: what every node said (its `launch: error` lines),
    whether each said one line, and whether that line names the rank at fault. Exit status 0 when every node said
    one line naming it, with no traceback."""
    bad = 0
    for what, extra in FAULTS.items():
        run_dir, port, started = out / f"fault{len(what)}", free_port(), time.time()
        overrides = [
            *extra,
            f"batch.global_size={GLOBAL}",
            "batch.micro_size=1",
            "trainer.max_steps=6",
            "trainer.collective_timeout=60",
            "rdzv.join_timeout=600",
        ]
        own = {20: [f"hydra.run.dir={out / 'apart'}"]} if not extra else {}
        with Job(nodes, run_dir, overrides, port, f"fault{len(what)}", own=own) as job:
            codes = job.wait(timeout=1800)
        said = [[line for line in job.err(n).splitlines() if line.startswith("launch: error")] for n in range(nodes)]
        lines = [len(s) for s in said]
        traced = sum(("Traceback" in job.err(n) or "frame #" in job.err(n)) for n in range(nodes))
        named = sum(bool(s) and "rank 20" in s[0] for s in said)
        distinct: dict[str, int] = {}
        for s in said:
            for line in s:
                distinct[line] = distinct.get(line, 0) + 1
        print(
            f"\n{what} ({nodes} nodes, {time.time() - started:.0f} s): exit codes {sorted(set(codes))}; error "
            f"lines per node {sorted(set(lines))}; {named} of {nodes} name rank 20; {traced} with a traceback"
        )
        for line, count in sorted(distinct.items(), key=lambda item: -item[1]):
            print(f"  {count} x {line[:400]}")
        if any(c == 0 for c in codes) or set(lines) != {1} or traced or named != nodes:
            bad += 1
    return 1 if bad else 0
