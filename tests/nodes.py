"""One elastic job's nodes on loopback, each a launcher in a session of its own (to be killed whole, as a lost machine
is), and what a test reads back of them: the metrics, the resume line, what is left in shared memory."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from conftest import LAUNCH, TINY, Run, clean_env, launch
from processes import listening, until

from launcher.recovery import shm as memory

RESUMED = re.compile(r"launch: resumed from step (\d+) \((memory|disk) tier[^)]*\): (\d+) step\(s\) replayed")

ELASTIC = [
    *TINY,
    "model._target_=faulty.KilledOnceGPT",
    "batch.global_size=12",
    "batch.micro_size=1",
    "trainer.max_steps=8",
    "trainer.collective_timeout=60",
]
"""lcm(3, 4) samples a step: the same global batch at world size 4 (accumulation 3) and 3 (accumulation 4)."""


def rows_of(run_dir: Path) -> list[dict[str, float]]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def left_in_shm(run_dir: Path) -> list[str]:
    run_id = (run_dir / "run_id").read_text().strip()
    return sorted(p.name for p in memory.SHM.glob(f"{memory.PREFIX}{run_id}-*"))


def worst_loss(rows: list[dict[str, float]], reference: dict[int, float]) -> float:
    return max(abs(r["loss"] - reference[int(r["step"])]) for r in rows)


def job_nodes(
    tmp_path: Path, name: str, nodes: str, extra: list[str], count: int = 4, etcd: str | None = None
) -> tuple[list[subprocess.Popen[bytes]], Path]:
    """`count` one-rank nodes of one elastic job on loopback, the memory tier on. Its rendezvous: the c10d store,
    which the first node binds; or, given `etcd` (HOST:PORT), etcd's, which no node hosts."""
    run_dir = tmp_path / name
    if etcd is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rdzv = [f"rdzv.endpoint=127.0.0.1:{port}"]
    else:
        rdzv = ["rdzv.backend=etcd-v2", f"rdzv.endpoint={etcd}"]
    argv = [
        LAUNCH,
        *ELASTIC,
        "+model.sleep_s=0.2",
        f"+model.while_there={tmp_path / 'kill'}",
        f"nodes={nodes}",
        "gpus=1",
        *rdzv,
        f"rdzv.id={name}",
        "rdzv.last_call_timeout=5",
        "trainer.max_restarts=3",
        "trainer.memory_checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    started = []
    for n in range(count):
        started.append(node_launcher(tmp_path, f"{name}{n}", argv))
        if n == 0 and etcd is None:  # it binds the rendezvous store
            until(lambda: listening(port), started[0], what="the rendezvous store")
    return started, run_dir


def node_launcher(tmp_path: Path, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """One node's launcher, its output in tmp_path/<name>.out."""
    with open(tmp_path / f"{name}.out", "w") as out:
        env = clean_env(tmp_path)
        return subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_nodes(run_dir: Path, nodes: list[subprocess.Popen[bytes]], ranks: list[int]) -> None:
    """The nodes that run `ranks` killed whole (launcher and worker), and their shared memory gone with them, as a
    lost machine's is."""
    records = [json.loads((run_dir / "logs" / "ranks" / f"rank{r}.json").read_text()) for r in ranks]
    pids = {int(record["launcher"].split(":")[1]) for record in records}
    for node in nodes:
        if node.pid in pids:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:  # it killed itself
                pass
            node.wait()
    run_id = (run_dir / "run_id").read_text().strip()
    for pid in pids:
        for folder in memory.SHM.glob(f"{memory.PREFIX}{run_id}-*-{pid}"):
            shutil.rmtree(folder)


def outputs(tmp_path: Path, name: str, count: int = 4) -> str:
    return "".join((tmp_path / f"{name}{n}.out").read_text() for n in range(count))


@contextmanager
def ended_on_exit(nodes: list[subprocess.Popen[bytes]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The job's nodes, each still running on the way out (a test that failed) killed whole."""
    try:
        yield nodes
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)


def beside_one(
    tmp_path: Path, nodes: list[subprocess.Popen[bytes]], reference: list[str], timeout: float
) -> tuple[list[int], Run]:
    """Wait for the nodes still running while one process trains `reference` (its overrides) beside them, in
    tmp_path/one: the nodes' exit codes, and the one process's run."""
    with ThreadPoolExecutor(1) as pool:
        one = pool.submit(launch, tmp_path, *reference, name="one")
        codes = [n.wait(timeout=timeout) for n in nodes if n.returncode is None]
        return codes, one.result()


def went_on_exactly(out: str, run_dir: Path, one: Run, resumed: int, steps: int) -> list[dict[str, float]]:
    """Check that the job resumed from step `resumed` out of memory, none replayed, trained steps 1 to `steps` once
    each, every loss one process's (`one`) within 1e-6, and left nothing in /dev/shm; its metrics' rows."""
    said = RESUMED.search(out)
    assert said and said.groups() == (str(resumed), "memory", "0"), out[-4000:]
    rows = rows_of(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1)), rows  # no step trained twice
    assert one.returncode == 0, one.stderr
    assert worst_loss(rows, {int(r["step"]): r["loss"] for r in one.metrics}) <= 1e-6
    assert left_in_shm(run_dir) == []
    return rows
