"""bench/scale.py --elastic: nodes=14:16 on 16 one-rank nodes; a 17th refused in one line; 2 killed; the other 14
go on exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from scale_job import JOB, LAUNCH, Job, StoreHost, free_port, rows, until

LEAST, MOST = 14, 16
ELASTIC_GLOBAL = 1680
"""lcm(14, 15, 16): nodes=14:16 may run at any world size from 14 to 16, and the global batch must divide over each
(the launcher refuses a range it does not divide over), here at micro-batch 1: 105 micro-steps per rank and step at 16
nodes. (A range from 12 would need lcm(12, ..., 16) = 21,840, 13 times the steps' work, for the same rehearsal.)"""


def elastic(steps: int, out: Path) -> int:
    """nodes=14:16: 16 one-rank nodes train; a 17th that joins the full job is refused in one line; 2 nodes are
    killed whole (launcher and worker); the other 14 go on after a restart from the last checkpoint. Every logged
    loss, the redone steps' too, is one process's at the same global batch (within 1e-6). Exit status 0 when it is."""
    shape = [
        f"batch.global_size={ELASTIC_GLOBAL}",
        "data.seq_len=8",
        "data.num_samples=65536",
        "trainer.collective_timeout=120",
        f"trainer.max_steps={steps}",
    ]
    one = subprocess.run(
        [LAUNCH, *JOB, *shape, "gpus=1", f"batch.micro_size={ELASTIC_GLOBAL // MOST}", f"hydra.run.dir={out / 'one'}"],
        cwd=out,
        capture_output=True,
        text=True,
    )
    if one.returncode:
        print(f"one process failed:\n{one.stderr[-3000:]}")
        return 1
    reference = {r["step"]: r["loss"] for r in rows(out / "one")}
    run_dir, port, started = out / "elastic", free_port(), time.time()
    overrides = [
        *shape,
        "batch.micro_size=1",
        "trainer.checkpoint_every=1",
        "trainer.max_restarts=3",
        "rdzv.last_call_timeout=5",
    ]
    nodes = f"{LEAST}:{MOST}"
    with StoreHost(port, out, trace=False), Job(nodes, run_dir, overrides, port, "elastic16", count=MOST) as job:
        until(lambda: sum(r["world_size"] == MOST for r in rows(run_dir)) >= 2, job, f"two steps at {MOST} nodes")
        print(f"{MOST} nodes: 2 steps after {time.time() - started:.0f} s")
        spare = job.add([])
        spare.proc.wait(timeout=600)
        refused = [line for line in job.err(MOST).splitlines() if line.startswith("launch: error")]
        print(f"a node beyond {MOST}: exit {spare.proc.returncode}, said {refused}")
        if spare.proc.returncode == 0 or len(refused) != 1 or f"runs on its {MOST} nodes already" not in refused[0]:
            print(job.err(MOST)[-3000:])
            return 1
        at = len(rows(run_dir))
        if at > steps - 3:  # the rehearsal is of the steps after the loss: at least 3 of them
            print(f"{MOST} nodes reached step {at} of {steps} before the kill: run it with more --steps")
            return 1
        for member in job.members[LEAST:MOST]:
            os.killpg(member.proc.pid, signal.SIGKILL)
        print(f"{MOST - LEAST} nodes killed at step {at} ({time.time() - started:.0f} s)")
        codes = [m.proc.wait(timeout=3600) for m in job.members[:LEAST]]
        if any(codes):
            print(f"the {LEAST} nodes left: exit codes {codes}\n{job.output()[-4000:]}")
            return 1
    logged = rows(run_dir)
    worlds = sorted({int(r["world_size"]) for r in logged})
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in logged)
    steps_done = sorted({int(r["step"]) for r in logged})
    print(
        f"world sizes {worlds}, steps {steps_done[0]}-{steps_done[-1]} ({len(logged)} logged, redone ones too), "
        f"largest difference from one process {worst:.2e}; {time.time() - started:.0f} s"
    )
    ok = worlds == [LEAST, MOST] and steps_done == list(range(1, steps + 1)) and worst <= 1e-6
    print(
        f"{'exact' if ok else 'NOT EXACT'}: nodes={LEAST}:{MOST}, {MOST} nodes then {LEAST} after {MOST - LEAST} "
        f"were killed, global batch {ELASTIC_GLOBAL}, against one process"
    )
    return 0 if ok else 1
