"""bench/scale.py --elastic: nodes=12:16 on 16 one-rank nodes; a 17th refused in one line; 3 killed; the other 13
go on exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from scale_job import JOB, LAUNCH, Job, StoreHost, free_port, rows, until

ELASTIC_GLOBAL = 21840
"""lcm(12, ..., 16): nodes=12:16 may run at any world size from 12 to 16, and the global batch must divide over each
(the launcher refuses a range it does not divide over), here at micro-batch 1."""


def elastic(steps: int, out: Path) -> int:
    """nodes=12:16: 16 one-rank nodes train; a 17th that joins the full job is refused in one line; 3 nodes are
    killed whole (launcher and worker); the other 13 go on after a restart from the last checkpoint. Every logged
    loss, the redone steps' too, is one process's at the same global batch (within 1e-6). Exit status 0 when it is."""
    shape = [f"batch.global_size={ELASTIC_GLOBAL}", "data.seq_len=8", "data.num_samples=65536",
             "trainer.collective_timeout=120", f"trainer.max_steps={steps}"]  # fmt: skip
    one = subprocess.run([LAUNCH, *JOB, *shape, "gpus=1", "batch.micro_size=1365", f"hydra.run.dir={out / 'one'}"],
                         cwd=out, capture_output=True, text=True)  # fmt: skip
    if one.returncode:
        print(f"one process failed:\n{one.stderr[-3000:]}")
        return 1
    reference = {r["step"]: r["loss"] for r in rows(out / "one")}
    run_dir, port, started = out / "elastic", free_port(), time.time()
    overrides = [*shape, "batch.micro_size=1", "trainer.checkpoint_every=1", "trainer.max_restarts=3",
                 "rdzv.last_call_timeout=5"]  # fmt: skip
    with StoreHost(port, out, trace=False), Job("12:16", run_dir, overrides, port, "elastic16", count=16) as job:
        until(lambda: sum(r["world_size"] == 16 for r in rows(run_dir)) >= 2, job, "two steps at 16 nodes")
        print(f"16 nodes: 2 steps after {time.time() - started:.0f} s")
        spare = job.add([])
        spare.proc.wait(timeout=600)
        refused = [line for line in job.err(16).splitlines() if line.startswith("launch: error")]
        print(f"a 17th node: exit {spare.proc.returncode}, said {refused}")
        if spare.proc.returncode == 0 or len(refused) != 1 or "runs on its 16 nodes already" not in refused[0]:
            print(job.err(16)[-3000:])
            return 1
        at = len(rows(run_dir))
        for member in job.members[13:16]:
            os.killpg(member.proc.pid, signal.SIGKILL)
        print(f"3 nodes killed at step {at} ({time.time() - started:.0f} s)")
        codes = [m.proc.wait(timeout=3600) for m in job.members[:13]]
        if any(codes):
            print(f"the 13 nodes left: exit codes {codes}\n{job.output()[-4000:]}")
            return 1
    logged = rows(run_dir)
    worlds = sorted({int(r["world_size"]) for r in logged})
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in logged)
    steps_done = sorted({int(r["step"]) for r in logged})
    print(f"world sizes {worlds}, steps {steps_done[0]}-{steps_done[-1]} ({len(logged)} logged, redone ones too), "
          f"largest difference from one process {worst:.2e}; {time.time() - started:.0f} s")  # fmt: skip
    ok = worlds == [13, 16] and steps_done == list(range(1, steps + 1)) and worst <= 1e-6
    print(f"{'exact' if ok else 'NOT EXACT'}: nodes=12:16, 16 nodes then 13 after 3 were killed, global batch "
          f"{ELASTIC_GLOBAL}, against one process")  # fmt: skip
    return 0 if ok else 1
