"""The launcher's own costs as the number of nodes grows: N launchers as N one-rank nodes on loopback.

python bench/scale.py [--nodes 1,2,4,8,16,32] [--steps 6] [--json out.json]
python bench/scale.py --check [--nodes 32] [--resume-nodes 8] [--out FOLDER]
python bench/scale.py --elastic [--steps 20]
python bench/scale.py --faults [--nodes 32]

Each N is one job: N `launch` processes started together, each a node (`nodes=N gpus=1`, c10d rendezvous on
127.0.0.1, one shared run directory), each forking its one CPU rank; the tiny GPT (1 layer x 32) on random tokens,
global batch 32 at every N (micro-batch 32/N), `--steps` steps logged each, a checkpoint every 2 steps (all kept).
The rendezvous store is hosted by a process of the bench's own on the endpoint (the nodes then all connect to it as
clients, as the nodes of a cluster connect to node 0's), with the store's trace on (TORCH_CPP_LOG_LEVEL=INFO,
TORCH_DISTRIBUTED_DEBUG=DETAIL: one line per request it serves): torch exposes no request count, its trace is what
counts them. For each N:
- start: seconds from the first launcher's start to the last node's checked config (its launch line), to the last
  rank in the process group (`logs/ranks/rank<N>.json`), and to the end of the first optimizer step (every node's
  first step: it ends in collectives every rank takes part in, so the last node's first step ends with it);
- checks: the CPU seconds a launcher spent up to its launch line (imports, composition, the meta-device model, the
  checks, the claim of the run directory; the median node's and the slowest's), and the CPU seconds of every process
  of the job up to the first step, per node;
- checkpoints: a save's stall (`checkpoint_stall_s`, the slowest rank's, the mean of the saves after the first), the
  newest manifest's bytes and files, the seconds to verify it (`checkpoint.format.damage`: every file read and
  hashed), and to find the newest verified checkpoint among those saved (`newest_intact`: what rank 0 does at start
  before any rank loads), both timed in this process on the run's folder (the fastest of 3);
- the rendezvous store: requests up to the first step, per node; requests per second after it; the rendezvous state's
  bytes (which every one of those requests reads or writes whole);
- memory: the proportional set size (PSS: shared pages split between the processes sharing them) of every process of
  the job, summed, at its peak, per node; each launcher's and each worker's peak RSS; the machine's available memory
  at its lowest.
Then each figure's growth over N (the slope of log figure against log N over N >= 2, where the one-node path's own
shortcuts are gone): constant, linear, or worse, with the N at which a figure growing worse than linearly would reach
a minute. On this machine's 2 cores, N launchers share 2 CPUs: the wall times grow with N for that alone (N nodes'
CPU seconds over 2 cores), which is what the CPU seconds per node tell apart.

--check: the exactness at scale, what tests/test_scale.py runs. One process trains `--steps` steps at global batch
32; `--nodes` one-rank nodes train the first half of them and save; `--resume-nodes` nodes resume that run directory
and train the rest. Every logged loss must be the one process's within 1e-6, or it exits 1.

--elastic: nodes=14:16 on 16 one-rank nodes (global batch 1680, which divides at every world size from 14 to 16);
a 17th node that joins is refused in one line; 2 nodes are killed whole; the other 14 go on after a restart, and every
logged loss is one process's within 1e-6.

--faults: one fault among 32 nodes, three times (rank 20 fails at its first step; rank 20 hangs; one node's run
directory is its own): what every node's terminal said, and whether each said one line naming the rank at fault.

Long timeouts are set (rdzv.join_timeout, trainer.collective_timeout: 900 s): 32 launchers on 2 cores take a minute
or two to meet.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scale_check import check
from scale_elastic import elastic
from scale_faults import faults
from scale_job import GLOBAL, ROOT, SHAPE, Job, StoreHost, free_port

# ------------------------------------------------------------------ one N


def fastest(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def measure(nodes: int, steps: int, out: Path) -> dict[str, float]:
    """One job of `nodes` nodes, and its figures."""
    sys.path.insert(0, str(ROOT))
    from launcher.checkpoint.format import MANIFEST, by_time, damage, newest_intact

    run_dir, port = out / f"nodes{nodes}", free_port()
    overrides = [
        *SHAPE,
        f"batch.micro_size={GLOBAL // nodes}",
        f"trainer.max_steps={steps}",
        "trainer.checkpoint_every=2",
    ]
    with StoreHost(port, out) as store, Job(nodes, run_dir, overrides, port, f"scale{nodes}") as job:
        codes = job.wait(timeout=1800)
        if any(codes):
            sys.exit(f"{nodes} nodes: exit codes {codes}\n{job.output()[-4000:]}")
        keys = store.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]["time"]
    joined = [p.stat().st_mtime for p in (run_dir / "logs" / "ranks").glob("rank*.json")]
    before = [s for s in job.samples if s.time <= first]
    requests = store.requests()
    at_start = [t for t, _, _ in requests if t <= first]
    last = rows[-1]["time"]  # the training's window: from the first step's end to the last's
    training = [(kind, key) for t, kind, key in requests if first < t <= last]
    state_key = max(keys, key=lambda k: keys[k] if "rendezvous" in k else -1)
    state = state_key.lstrip("/")
    state_reads = sum(kind in ("get", "compareAndSet") and key.lstrip("/") == state for kind, key in training)
    folder = run_dir / "checkpoints"
    newest = by_time(folder)[0]
    manifest = json.loads((newest / MANIFEST).read_text())
    stalls = [r["checkpoint_stall_s"] for r in rows if "checkpoint_stall_s" in r]
    return {
        "nodes": nodes,
        "said_s": max(m.said for m in job.members if m.said) - job.started,
        "joined_s": max(joined) - job.started,
        "first_step_s": first - job.started,
        "checks_cpu_s": statistics.median(m.checks_cpu for m in job.members if m.checks_cpu),
        "checks_cpu_max_s": max(m.checks_cpu for m in job.members if m.checks_cpu),
        "cpu_to_first_step_per_node_s": (before[-1].cpu if before else float("nan")) / nodes,
        "save_s": statistics.mean(stalls[1:] or stalls),
        "manifest_bytes": (newest / MANIFEST).stat().st_size,
        "files": len(manifest["files"]),
        "verify_s": fastest(lambda: damage(newest)),
        "find_newest_s": fastest(lambda: newest_intact(folder, say=lambda _: None)),
        "store_requests_at_start_per_node": len(at_start) / nodes,
        "store_requests_per_node_per_s": len(training) / (last - first) / nodes,
        "store_state_bytes": keys[state_key],
        "store_state_mb_per_s": state_reads / (last - first) * keys[state_key] / 1e6,
        "pss_per_node_mb": max(s.pss for s in job.samples) / nodes / 1e6,
        "launcher_rss_mb": max(s.launcher_rss for s in job.samples) / 1e6,
        "worker_rss_mb": max(s.worker_rss for s in job.samples) / 1e6,
        "available_drop_gb": (job.samples[0].available - min(s.available for s in job.samples)) / 1e9
        if job.samples
        else float("nan"),
        "wall_s": max(s.time for s in job.samples) - job.started if job.samples else float("nan"),
    }


# ------------------------------------------------------------------ fits

COLUMNS = {
    "said_s": "start to every node checked (s)",
    "joined_s": "start to every rank joined (s)",
    "first_step_s": "start to first step (s)",
    "checks_cpu_s": "a launcher's CPU to its checked config (s, median node)",
    "cpu_to_first_step_per_node_s": "CPU to first step per node (s)",
    "save_s": "save (s)",
    "verify_s": "verify (s)",
    "find_newest_s": "find newest verified (s)",
    "manifest_bytes": "manifest (bytes)",
    "store_requests_at_start_per_node": "store requests at start per node",
    "store_requests_per_node_per_s": "store requests per node per s, training",
    "store_state_bytes": "rendezvous state (bytes)",
    "store_state_mb_per_s": "state read and written per s, training (MB)",
    "pss_per_node_mb": "PSS per node (MB)",
}


def growth(figures: list[dict[str, float]], key: str) -> tuple[float, str]:
    """The slope of log figure against log N over N >= 2 (least squares), and what it says."""
    points = [(math.log(f["nodes"]), math.log(f[key])) for f in figures if f["nodes"] >= 2 and f[key] > 0]
    if len(points) < 2:
        return float("nan"), "too few points"
    mx, my = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    kind = "constant" if slope < 0.3 else "linear" if slope < 1.3 else "worse than linear"
    return slope, kind


def minute_at(figures: list[dict[str, float]], key: str, slope: float) -> float:
    """The N at which a figure growing as N^slope from the largest N measured reaches 60 (seconds)."""
    last = max(figures, key=lambda f: f["nodes"])
    return last["nodes"] * (60.0 / last[key]) ** (1.0 / slope)


def report(figures: list[dict[str, float]]) -> str:
    head = ["N", *COLUMNS.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figures:
        cells = [str(int(f["nodes"]))] + [_cell(f[k]) for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for key, words in COLUMNS.items():
        slope, kind = growth(figures, key)
        note = ""
        if kind == "worse than linear" and key.endswith("_s") and not key.endswith("_per_s"):  # seconds, not rates
            note = f"; a minute at N = {minute_at(figures, key, slope):,.0f}"
        lines.append(f"{words}: {kind} (N^{slope:.2f}){note}")
    last = figures[-1]
    lines.append(
        f"\nmemory at {int(last['nodes'])} nodes: launcher RSS {last['launcher_rss_mb']:.0f} MB, worker RSS "
        f"{last['worker_rss_mb']:.0f} MB, PSS {last['pss_per_node_mb']:.0f} MB per node; the machine's available "
        f"memory fell by {last['available_drop_gb']:.2f} GB at most"
    )
    return "\n".join(lines)


def _cell(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


# ------------------------------------------------------------------ --check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default=None, help="comma-separated N (default 1,2,4,8,16,32; --check: 32)")
    p.add_argument("--steps", type=int, default=None, help="default 40; --check: 6; --elastic: 20")
    p.add_argument("--check", action="store_true")
    p.add_argument("--elastic", action="store_true", help="nodes=14:16: a 17th refused, 2 killed, 14 go on exactly")
    p.add_argument("--faults", action="store_true", help="one fault among --nodes (default 32) nodes, each told")
    p.add_argument("--resume-nodes", type=int, default=8)
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder, removed after)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        out = a.out or Path(tmp)
        if a.check:
            sys.exit(check(int(a.nodes or 32), a.resume_nodes, a.steps or 6, out))
        if a.elastic:
            sys.exit(elastic(a.steps or 20, out))
        if a.faults:
            sys.exit(faults(int(a.nodes or 32), out))
        figures = []
        for n in [int(x) for x in (a.nodes or "1,2,4,8,16,32").split(",")]:
            figures.append(measure(n, a.steps or 40, out))
            print(json.dumps(figures[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=2))
    print(report(figures))


if __name__ == "__main__":
    main()
