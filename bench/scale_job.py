"""bench/scale.py's nodes: N `launch` processes of one job on loopback, each a one-rank node in a session of its
own, and the rendezvous store hosted by a process of the bench's own with its trace on (what counts its requests)."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(Path(sys.executable).parent / "launch")
GLOBAL = 32
JOB = [
    "model=gpt_tiny",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "data=synthetic",
    "data.seq_len=32",
    "logger=none",
    "trainer.progress=false",
    "device=cpu",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.warmup_steps=2",
    "trainer.keep_last=0",
    "rdzv.join_timeout=900",
]
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
        self.argv = [
            LAUNCH,
            *JOB,
            *overrides,
            f"nodes={nodes}",
            "gpus=1",
            f"rdzv.endpoint=127.0.0.1:{port}",
            f"rdzv.id={name}",
        ]
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
        proc = subprocess.Popen(
            [*self.argv, *extra],
            cwd=self.logs,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(self.logs / f"node{n}.err", "w"),
            text=True,
            start_new_session=True,
        )
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
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STORE_HOST, str(self.port)],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.trace, "w"),
        )
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


def rows(run_dir: Path) -> list[dict[str, float]]:
    """The run's logged rows (metrics.jsonl), none before its first step."""
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def until(condition, job: Job, what: str, timeout: float = 1800) -> None:  # type: ignore[no-untyped-def]
    """Wait for `condition`; SystemExit naming `what` if a node ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [n for n, m in enumerate(job.members) if m.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise SystemExit(f"no {what}: nodes {ended} ended\n{job.output()[-4000:]}")
        time.sleep(0.5)
