"""What a lost node costs, restarted from the disk, restarted from the memory tier, and recovered in place: N
one-rank nodes of one elastic job on loopback.

python bench/recovery.py [--nodes 4,8] [--steps 60] [--kill-at 37] [--out FOLDER]

For each N, three jobs of `nodes=N-1:N` (trainer.checkpoint_every=50, trainer.max_restarts=3), the same in all but
how they recover: without the memory tier (torch's restart, from the disk), with it (trainer.memory_checkpoint_every=1,
one replica; torch's restart), and in place (the tier, and trainer.recovery=in_place: the survivors go on in their
processes). In each, the node of rank N-1 is SIGKILLed whole (launcher and worker: `tests/faulty.py`'s KilledOnceGPT
kills its own process group) midway through step kill_at + 1 (after half its micro-steps); the N-1 nodes left go on
and finish. For each job:
- steps lost: the last step trained before the failure minus the step the job resumed from;
- seconds from the failure (the last step logged before it) to the first step trained again, and to the first step
  past the failure (the job back where it was);
- the step time before the failure (mean of the logged step_time_s, steps 5 to kill_at), and its ratio to the disk
  job's (what the tier costs per step);
- whether workers were started again at the new size (a lost node is a restart of every worker group under torch's
  agent, counted by it or not: a new rendezvous either way).
The model is the tiny GPT at 4 layers x 192, 64 tokens a sample, micro-batch 1: a step of 100 ms or more here. The
global batch divides over N and N-1 (lcm), so both world sizes train the same batches. On this machine's 2 cores the
N nodes share 2 CPUs: every figure is a loopback figure (see docs/checkpoints.md for what a GPU cluster changes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale_job import LAUNCH, ROOT, free_port, rows

MODEL = [
    "model=gpt_tiny",
    "model._target_=faulty.KilledOnceGPT",
    "model.n_layer=4",
    "model.n_embd=192",
    "model.n_head=4",
    "data=synthetic",
    "data.seq_len=64",
    "logger=none",
    "trainer.progress=false",
    "device=cpu",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.warmup_steps=2",
    "batch.micro_size=1",
    "rdzv.join_timeout=900",
    "rdzv.last_call_timeout=5",
    "trainer.collective_timeout=300",
    "trainer.max_restarts=3",
    "trainer.checkpoint_every=50",
    "trainer.save_at_end=false",
]


MODES = {"disk": [], "memory": ["trainer.memory_checkpoint_every=1"]}
MODES["in place"] = [*MODES["memory"], "trainer.recovery=in_place"]


def job(n: int, steps: int, kill_at: int, mode: str, out: Path) -> dict[str, float]:
    """One job of `n` one-rank nodes recovering by `mode`; its node of rank n-1 killed during step kill_at + 1. Its
    figures."""
    name = f"{mode.replace(' ', '_')}{n}"
    run_dir, kill, port = out / name, out / f"{name}.kill", free_port()
    global_batch = math.lcm(n, n - 1)
    k = global_batch // n  # micro-steps a step at n nodes: the kill comes mid-step kill_at + 1, after half of them
    kill.touch()
    args = [
        LAUNCH,
        *MODEL,
        f"batch.global_size={global_batch}",
        f"trainer.max_steps={steps}",
        f"nodes={n - 1}:{n}",
        "gpus=1",
        f"rdzv.endpoint=127.0.0.1:{port}",
        f"rdzv.id={name}",
        f"hydra.run.dir={run_dir}",
        f"+model.while_there={kill}",
        "+model.sleep_s=0",
        f"+model.bad_rank={n - 1}",
        f"+model.at_call={kill_at * k + k // 2 + 1}",
        "+model.whole_node=true",
        *MODES[mode],
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "OMP_"))}
    env |= {"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    nodes = []
    for i in range(n):
        log = open(out / f"{name}.node{i}.out", "w")
        nodes.append(
            subprocess.Popen(args, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        time.sleep(2.0 if i == 0 else 0.0)  # the first hosts the rendezvous store
    try:
        codes = [node.wait(timeout=3600) for node in nodes]
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    run_id = (run_dir / "run_id").read_text().strip()
    for folder in Path("/dev/shm").glob(f"launch-tier-{run_id}-*"):  # the killed node's, as its machine's would go
        shutil.rmtree(folder)
    logged = rows(run_dir)
    said = "".join((out / f"{name}.node{i}.out").read_text() for i in range(n))
    if sorted(codes).count(0) != n - 1 or not logged:
        print(f"{name}: exit codes {codes}\n{said[-3000:]}")
        raise SystemExit(1)
    split = max(i for i, r in enumerate(logged) if int(r["world_size"]) == n) + 1  # the lost node's recovery
    before, after = logged[:split], logged[split:]
    last, failed = int(before[-1]["step"]), float(before[-1]["time"])
    resumed = int(after[0]["step"]) - 1
    past = next(r for r in after if int(r["step"]) > last)
    times = [r["step_time_s"] for r in before if 5 <= int(r["step"]) <= kill_at]  # the mean: saves every N steps
    return {
        "lost": last - resumed,
        "resumed": resumed,
        "last": last,
        "first_s": float(after[0]["time"]) - failed,
        "back_s": float(past["time"]) - failed,
        "step_s": statistics.mean(times),
        "world_after": int(after[-1]["world_size"]),
        # A worker group started at the new size says its batch once (rank 0's line): in place, no worker starts.
        "started_again": f"x world size {n - 1} = global" in said,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="4,8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=37)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    a = parser.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="recovery-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    print(
        "| nodes | recovery | steps lost | s to first step trained again | s to the step past the failure | "
        "step s | cost per step | workers started again |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in map(int, a.nodes.split(",")):
        results[n] = {mode: job(n, a.steps, a.kill_at, mode, out) for mode in MODES}
        base = results[n]["disk"]["step_s"]
        for mode, r in results[n].items():
            again = "yes" if r["started_again"] else "no"
            print(
                f"| {n} | {mode} | {r['lost']} (resumed {r['resumed']}, last {r['last']}) | {r['first_s']:.1f} | "
                f"{r['back_s']:.1f} | {r['step_s']:.3f} | {r['step_s'] / base:.3f}x | {again} |",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
