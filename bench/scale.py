"""The launcher's own costs as the number of nodes grows: N launchers as N one-rank nodes on loopback.

python bench/scale.py [--nodes 1,2,4,8,16,32] [--steps 6] [--json out.json]
python bench/scale.py --check [--nodes 32] [--resume-nodes 8] [--out FOLDER]
python bench/scale.py --elastic [--steps 8]
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

--elastic: nodes=12:16 on 16 one-rank nodes (global batch 21840, which divides at every world size from 12 to 16);
a 17th node that joins is refused in one line; 3 nodes are killed whole; the other 13 go on after a restart, and every
logged loss is one process's within 1e-6.

--faults: one fault among 32 nodes, three times (rank 20 fails at its first step; rank 20 hangs; one node's run
directory is its own): what every node's terminal said, and whether each said one line naming the rank at fault.

Long timeouts are set (rdzv.join_timeout, trainer.collective_timeout: 900 s): 32 launchers on 2 cores take a minute
or two to meet.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(Path(sys.executable).parent / "launch")
GLOBAL = 32
JOB = [
    "model=gpt_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data=synthetic", "data.seq_len=32",
    "logger=none", "trainer.progress=false", "device=cpu", "trainer.log_every=1", "trainer.eval_every=0",
    "trainer.warmup_steps=2", "trainer.keep_last=0", "rdzv.join_timeout=900",
]  # fmt: skip
SHAPE = [f"batch.global_size={GLOBAL}", "trainer.collective_timeout=900"]
TICK = os.sysconf("SC_CLK_TCK")

STORE_HOST = """
import json, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, multi_tenant=True, use_libuv=True)
print("ready", flush=True)
sys.stdin.read()  # until the bench closes it, after the job
print(json.dumps({key: len(store.get(key)) for key in store.list_keys()}), flush=True)
"""
"""The rendezvous store, hosted where the bench can read its trace (stderr) and, at the end, its keys' sizes."""

TRACE = re.compile(
    r"^\[I\d{4} (\d\d:\d\d:\d\d\.\d+) TCPStoreLibUvBackend\.cpp:\d+\] \[c10d - trace\] (\w+)(?: key:(\S+))?"
)
HANDSHAKE = {"validate", "ping"}
"""A client's first two requests on each connection: counted as connections, not as requests."""


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) bytes of a live process, (0, 0) once it is gone."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, rss


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Node:
    proc: subprocess.Popen[str]
    log: Path
    said: float | None = None
    """When its launch line came: the config checked and the run directory claimed."""
    checks_cpu: float | None = None
    """The launcher's CPU seconds then."""
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        """Its output, line by line, into its log; the launch line timed."""
        assert self.proc.stdout is not None
        with open(self.log, "w") as log:
            for line in self.proc.stdout:
                if self.said is None and line.startswith("launch: ") and " worker(s) = " in line:
                    self.said = time.time()
                    stat = _stat(self.proc.pid)
                    self.checks_cpu = stat[1] if stat else None
                log.write(line)
                self.lines.append(line)


@dataclass
class Sample:
    time: float
    pss: int
    cpu: float
    available: int
    launcher_rss: int
    worker_rss: int


class Job:
    """Launchers of one job on loopback, each in a session of its own (ended whole, whatever happens): `count` of
    them (default: `nodes`, which may be a range MIN:MAX), each given `own[n]` after the job's overrides."""

    def __init__(
        self,
        nodes: int | str,
        run_dir: Path,
        overrides: list[str],
        port: int,
        name: str,
        count: int | None = None,
        own: dict[int, list[str]] | None = None,
    ) -> None:
        self.run_dir, self.count, self.own = run_dir, count or int(nodes), own or {}
        self.nodes = self.count
        self.logs = run_dir.parent / f"{run_dir.name}.logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.argv = [LAUNCH, *JOB, *overrides, f"nodes={nodes}", "gpus=1", f"rdzv.endpoint=127.0.0.1:{port}",
                     f"rdzv.id={name}"]  # fmt: skip
        self.members: list[Node] = []
        self.samples: list[Sample] = []
        self.started = 0.0
        self._done = threading.Event()

    def __enter__(self) -> Job:
        self.started = time.time()
        for n in range(self.count):
            self.add(self.own.get(n, []))
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def add(self, extra: list[str]) -> Node:
        """One more launcher of this job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "OMP_"))}
        tests = str(ROOT / "tests")  # the fault models (tests/faulty.py)
        # One thread per worker: the nodes share this machine's cores. The launcher would give each node's worker all
        # of them, and 16 nodes' OpenMP threads, spinning on 2 cores, took minutes over a step of 1,365 micro-steps
        # that one thread each runs in seconds.
        env |= {"PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": tests, "OMP_NUM_THREADS": "1"}
        n = len(self.members)
        if not any(o.startswith("hydra.run.dir=") for o in extra):
            extra = [*extra, f"hydra.run.dir={self.run_dir}"]
        proc = subprocess.Popen([*self.argv, *extra], cwd=self.logs, env=env, stdout=subprocess.PIPE,
                                stderr=open(self.logs / f"node{n}.err", "w"), text=True,
                                start_new_session=True)  # fmt: skip
        node = Node(proc, self.logs / f"node{n}.out")
        threading.Thread(target=node.read, daemon=True).start()
        self.members.append(node)
        return node

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [m.proc.wait(timeout=max(1.0, deadline - time.monotonic())) for m in self.members]

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for m in self.members:
            try:
                os.killpg(m.proc.pid, signal.SIGKILL)  # the launcher and its worker, if anything is left
            except ProcessLookupError:
                pass
            m.proc.wait()

    def _sample(self) -> None:
        """Every second: the job's processes (each launcher and what it forked), their PSS, RSS and CPU seconds."""
        launchers = {m.proc.pid for m in self.members}
        while not self._done.wait(1.0):
            family: dict[int, float] = {}
            for proc in Path("/proc").iterdir():
                if (
                    proc.name.isdigit()
                    and (stat := _stat(int(proc.name)))
                    and (int(proc.name) in launchers or stat[0] in launchers)
                ):
                    family[int(proc.name)] = stat[1]
            memory = {pid: _memory(pid) for pid in family}
            self.samples.append(
                Sample(
                    time.time(),
                    sum(p for p, _ in memory.values()),
                    sum(family.values()),
                    _available(),
                    max((r for pid, (_, r) in memory.items() if pid in launchers), default=0),
                    max((r for pid, (_, r) in memory.items() if pid not in launchers), default=0),
                )
            )

    def output(self) -> str:
        return "".join(line for m in self.members for line in m.lines) + "".join(
            self.err(n) for n in range(len(self.members))
        )

    def err(self, n: int) -> str:
        return (self.logs / f"node{n}.err").read_text()


class StoreHost:
    """The rendezvous store on `port`, in a process of its own with the store's trace on."""

    def __init__(self, port: int, folder: Path, trace: bool = True) -> None:
        self.port, self.trace, self.traced = port, folder / "store.trace", trace

    def __enter__(self) -> StoreHost:
        env = (
            {**os.environ, "TORCH_CPP_LOG_LEVEL": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if self.traced else None
        )
        self.proc = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(self.port)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.trace, "w"))  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def close(self) -> dict[str, int]:
        """The store's keys and their values' sizes, once the job is over."""
        out, _ = self.proc.communicate("", timeout=60)
        return json.loads(out.strip().splitlines()[-1])

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def requests(self) -> list[tuple[float, str, str]]:
        """(time, request, key) for each request the store served; the connections' handshakes left out."""
        today = datetime.date.today()
        found = []
        for line in self.trace.read_text().splitlines():
            if (m := TRACE.match(line)) and m.group(2) not in HANDSHAKE:
                clock = datetime.time.fromisoformat(m.group(1))
                found.append((datetime.datetime.combine(today, clock).timestamp(), m.group(2), m.group(3) or ""))
        return found


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
    overrides = [*SHAPE, f"batch.micro_size={GLOBAL // nodes}", f"trainer.max_steps={steps}",
                 "trainer.checkpoint_every=2"]  # fmt: skip
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


def check(nodes: int, resume_nodes: int, steps: int, out: Path) -> int:
    """`nodes` one-rank nodes train the first half of `steps` and save, `resume_nodes` resume and train the rest: every
    logged loss is one process's at the same global batch, within 1e-6. Exit status 0 when it is."""
    half = steps // 2
    one = subprocess.run([LAUNCH, *JOB, *SHAPE, "gpus=1", "batch.micro_size=8", f"trainer.max_steps={steps}",
                          f"hydra.run.dir={out / 'one'}"], cwd=out, capture_output=True, text=True)  # fmt: skip
    if one.returncode:
        print(f"one process failed:\n{one.stderr[-3000:]}")
        return 1
    reference = {r["step"]: r["loss"] for r in map(json.loads, (out / "one" / "metrics.jsonl").open())}
    run_dir, worst, started = out / "nodes", {}, time.time()
    for count, last in ((nodes, half), (resume_nodes, steps)):
        port = free_port()
        overrides = [*SHAPE, f"batch.micro_size={GLOBAL // count}", f"trainer.max_steps={last}"]
        with Job(count, run_dir, overrides, port, f"check{count}") as job:
            codes = job.wait(timeout=1800)
            if any(codes):
                print(f"{count} nodes: exit codes {codes}\n{job.output()[-4000:]}")
                return 1
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        mine = [r for r in rows if int(r["world_size"]) == count]
        worst[count] = max(abs(r["loss"] - reference[r["step"]]) for r in mine)
        print(f"{count} nodes: steps {mine[0]['step']}-{mine[-1]['step']}, largest difference from one process "
              f"{worst[count]:.2e} ({time.time() - started:.0f} s since the first node's start)")  # fmt: skip
    steps_logged = sorted(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    if steps_logged != list(range(1, steps + 1)):
        print(f"logged steps {steps_logged}, not 1-{steps}: the resume did not continue where the save left off")
        return 1
    exact = all(w <= 1e-6 for w in worst.values())
    print(f"{'exact' if exact else 'NOT EXACT'}: {nodes} nodes then {resume_nodes} nodes against one process, "
          f"global batch {GLOBAL}: largest difference {max(worst.values()):.2e} (<= 1e-6)")  # fmt: skip
    return 0 if exact else 1


# ------------------------------------------------------------------ --elastic

ELASTIC_GLOBAL = 21840
"""lcm(12, ..., 16): nodes=12:16 may run at any world size from 12 to 16, and the global batch must divide over each
(the launcher refuses a range it does not divide over), here at micro-batch 1."""


def _rows(run_dir: Path) -> list[dict[str, float]]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _until(condition, job: Job, what: str, timeout: float = 1800) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [n for n, m in enumerate(job.members) if m.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise SystemExit(f"no {what}: nodes {ended} ended\n{job.output()[-4000:]}")
        time.sleep(0.5)


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
    reference = {r["step"]: r["loss"] for r in _rows(out / "one")}
    run_dir, port, started = out / "elastic", free_port(), time.time()
    overrides = [*shape, "batch.micro_size=1", "trainer.checkpoint_every=1", "trainer.max_restarts=3",
                 "rdzv.last_call_timeout=5"]  # fmt: skip
    with StoreHost(port, out, trace=False), Job("12:16", run_dir, overrides, port, "elastic16", count=16) as job:
        _until(lambda: sum(r["world_size"] == 16 for r in _rows(run_dir)) >= 2, job, "two steps at 16 nodes")
        print(f"16 nodes: 2 steps after {time.time() - started:.0f} s")
        spare = job.add([])
        spare.proc.wait(timeout=600)
        refused = [line for line in job.err(16).splitlines() if line.startswith("launch: error")]
        print(f"a 17th node: exit {spare.proc.returncode}, said {refused}")
        if spare.proc.returncode == 0 or len(refused) != 1 or "runs on its 16 nodes already" not in refused[0]:
            print(job.err(16)[-3000:])
            return 1
        at = len(_rows(run_dir))
        for member in job.members[13:16]:
            os.killpg(member.proc.pid, signal.SIGKILL)
        print(f"3 nodes killed at step {at} ({time.time() - started:.0f} s)")
        codes = [m.proc.wait(timeout=3600) for m in job.members[:13]]
        if any(codes):
            print(f"the 13 nodes left: exit codes {codes}\n{job.output()[-4000:]}")
            return 1
    rows = _rows(run_dir)
    worlds = sorted({int(r["world_size"]) for r in rows})
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in rows)
    steps_done = sorted({int(r["step"]) for r in rows})
    print(f"world sizes {worlds}, steps {steps_done[0]}-{steps_done[-1]} ({len(rows)} logged, redone ones too), "
          f"largest difference from one process {worst:.2e}; {time.time() - started:.0f} s")  # fmt: skip
    ok = worlds == [13, 16] and steps_done == list(range(1, steps + 1)) and worst <= 1e-6
    print(f"{'exact' if ok else 'NOT EXACT'}: nodes=12:16, 16 nodes then 13 after 3 were killed, global batch "
          f"{ELASTIC_GLOBAL}, against one process")  # fmt: skip
    return 0 if ok else 1


# ------------------------------------------------------------------ --faults

FAULTS = {
    "a rank that fails at its first step": ["model._target_=faulty.RaisingGPT", "+model.bad_rank=20",
                                            "+model.at_call=1"],
    "a rank that hangs": ["model._target_=faulty.HangingGPT", "+model.bad_rank=20", "+model.at_call=3"],
    "a node whose run directory is its own": [],
}  # fmt: skip


def faults(nodes: int, out: Path) -> int:
    """One fault among `nodes` one-rank nodes, for each of FAULTS: what every node said (its `launch: error` lines),
    whether each said one line, and whether that line names the rank at fault. Exit status 0 when every node said
    one line naming it, with no traceback."""
    bad = 0
    for what, extra in FAULTS.items():
        run_dir, port, started = out / f"fault{len(what)}", free_port(), time.time()
        overrides = [*extra, f"batch.global_size={GLOBAL}", "batch.micro_size=1", "trainer.max_steps=6",
                     "trainer.collective_timeout=60", "rdzv.join_timeout=600"]  # fmt: skip
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default=None, help="comma-separated N (default 1,2,4,8,16,32; --check: 32)")
    p.add_argument("--steps", type=int, default=None, help="default 40; --check: 6")
    p.add_argument("--check", action="store_true")
    p.add_argument("--elastic", action="store_true", help="nodes=12:16: a 17th refused, 3 killed, 13 go on exactly")
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
            sys.exit(elastic(a.steps or 8, out))
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
