"""Shared helpers: run the real `launch` console script in a subprocess and read what it wrote."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

pytest.register_assert_rewrite("nodes")  # its checks fail as a test's own asserts do, with the values compared

LAUNCH = str(Path(sys.executable).parent / "launch")

# Small and fast: the tiny GPT on short sequences, every step logged.
TINY = [
    "model=gpt_tiny",
    "data=synthetic",
    "data.seq_len=32",
    "model.n_layer=2",
    "model.n_embd=64",
    "logger=none",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.warmup_steps=2",
    "trainer.progress=false",
    "device=cpu",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict[str, float]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def check(self) -> Run:
        assert self.returncode == 0, f"launch exited {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self

    def refused(self) -> str:
        """The one-line error of a run refused before any worker started (exit 2, nothing written); returns the line."""
        assert self.returncode == 2, (self.returncode, self.stdout, self.stderr)
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("launch: error: "), self.stderr
        assert not self.run_dir.exists(), sorted(self.run_dir.rglob("*"))  # nothing written, not even the folder
        return lines[0]


REQUIRES = {
    "LAUNCH_TEST_REQUIRE_ASYNC_IO": "DeepSpeed's async I/O op, built against libaio (ZeRO-Infinity's tests)",
    "LAUNCH_TEST_REQUIRE_SLURM": "a real SLURM cluster started on this machine: slurm-wlm's daemons, as root "
    "(tests/test_slurm.py)",
    "LAUNCH_TEST_REQUIRE_POSTGRES": "a PostgreSQL server started for the tests in a temporary folder: Debian's "
    "postgresql package (initdb, pg_ctl) and the psycopg driver (launch[postgres])",
    "LAUNCH_TEST_REQUIRE_ETCD": "an etcd server started for the tests in a temporary folder, its v2 API on: Debian's "
    "etcd-server package and the python-etcd client (launch[etcd])",
    "LAUNCH_TEST_REQUIRE_ROOT": "root's powers: a tmpfs mounted (a disk that fills), a memory cgroup made (a worker "
    "killed for memory), a read-only folder (an NVMe path that cannot be written)",
}
"""What a test needs of the machine beyond the project's packages, by the flag that says the machine has it. A test
that finds it missing skips, saying why (`unavailable`), unless its flag is 1: then it fails. `.ci/run` sets every
flag, after installing libaio and SLURM, as root: nothing skips there."""


def unavailable(flag: str, why: str) -> NoReturn:
    """Skip this test for `why` (what this machine lacks); fail it instead where `flag`=1 says the machine has it."""
    assert flag in REQUIRES, flag
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {why}")
    pytest.skip(why)


@functools.cache
def async_io_problem() -> str | None:
    from strategies.deepspeed.ops import async_io_problem as problem

    return problem("cpu")


def require_async_io() -> None:
    """For tests of ZeRO-Infinity, which needs DeepSpeed's async I/O op and so libaio."""
    problem = async_io_problem()
    if problem is not None:
        unavailable("LAUNCH_TEST_REQUIRE_ASYNC_IO", problem)


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TORCHELASTIC_", "OMP_"))}
    env |= {
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "0",
        "PYTHONWARNINGS": "ignore",
        # workers can import the test models in faulty.py
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    }
    return env


def launch(
    tmp_path: Path, *overrides: str, name: str = "run", env: dict[str, str] | None = None, timeout: float = 300
) -> Run:
    """Run `launch` with the given overrides; its run directory is tmp_path/name."""
    run_dir = tmp_path / name
    proc = subprocess.run(
        [LAUNCH, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env or clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def launch_here(tmp_path: Path, *overrides: str, name: str = "run") -> Run:
    """`launch` in this test process (`cli_here`), for runs that end before any worker starts; its run directory is
    tmp_path/name."""
    run_dir = tmp_path / name
    proc = cli_here(tmp_path, *overrides, f"hydra.run.dir={run_dir}")
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def cli_here(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`launch ARGS` in this test process, in `cwd`, through the entry point the console script calls
    (`launcher.parent.cli.main`): its exit status and what it printed, as `launch` would give them, for what ends before
    any worker starts (a refusal, `launch plan`, `--cfg`)."""
    import io

    from hydra.core.global_hydra import GlobalHydra

    from launcher.models.loss import say_once
    from launcher.parent.cli import main

    say_once.cache_clear()  # what a launch says once, it says in this one too, as a process of its own would
    out, err, argv, here = io.StringIO(), io.StringIO(), sys.argv, os.getcwd()
    saved = {key: os.environ.get(key) for key in ("HYDRA_FULL_ERROR", "WANDB_SILENT")}
    os.environ.update(HYDRA_FULL_ERROR="0", WANDB_SILENT="true")
    os.chdir(cwd)
    loggers = _logging_state()
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as e:
                code = e.code
                if isinstance(code, str):  # what the interpreter would print on its way out
                    print(code, file=sys.stderr)
    finally:
        sys.argv = argv
        os.chdir(here)
        _restore_logging(loggers)
        GlobalHydra.instance().clear()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    status = code if isinstance(code, int) else int(code is not None)
    return subprocess.CompletedProcess(["launch", *args], status, out.getvalue(), err.getvalue())


def _logging_state() -> dict[Any, tuple[list[Any], int, bool]]:
    import logging

    every = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return {lg: (list(lg.handlers), lg.level, lg.disabled) for lg in every}


def _restore_logging(saved: dict[Any, tuple[list[Any], int, bool]]) -> None:
    """Hydra's job logging, set up by an in-process launch, points handlers at that run's launch.log: they are closed
    and the loggers put back as they were, or a later test's log line would write into (or fail on) a removed folder."""
    import logging

    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if not isinstance(lg, logging.Logger):
            continue
        handlers, level, disabled = saved.get(lg, ([], logging.NOTSET, False))
        for handler in lg.handlers:
            if handler not in handlers:
                handler.close()
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.disabled = disabled


@pytest.fixture
def run_launch(tmp_path: Path):
    def _run(*overrides: str, name: str = "run", **kw) -> Run:
        return launch(tmp_path, *overrides, name=name, **kw)

    return _run


def launch_once(
    tmp_path: Path, *overrides: str, name: str, timeout: float = 300, env: dict[str, str] | None = None
) -> Run:
    """`launch` once per test session, whichever test process asks first; the others wait for it and read its result."""
    record = tmp_path / f"{name}.run.json"
    with open(tmp_path / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed holder dies
        if record.exists():
            saved = json.loads(record.read_text())
            return Run(**{**saved, "run_dir": Path(saved["run_dir"])})
        run = launch(tmp_path, *overrides, name=name, timeout=timeout, env=env)
        record.write_text(json.dumps(asdict(run), default=str))
        return run


@pytest.fixture(scope="session")
def conformance_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the conformance suite's runs live; other suites read the same runs instead of repeating them.

    One folder for the whole session: pytest-xdist gives each of its workers a base folder of its own
    (`<session>/popen-gwN`), so the workers meet in the session's.
    """
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "conformance"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def one_process(conformance_dir: Path) -> Run:
    """The conformance suite's one-process run (plain DDP, the same global batch: K = 4), made in the setup of the
    first test that asks for it: --durations reports its cost as that setup, not as any test's own."""
    from runs import reference

    return reference(conformance_dir)


@pytest.fixture(scope="session")
def ddp_run(conformance_dir: Path) -> Run:
    """The conformance suite's run of DDP on 2 ranks (checkpoints at steps 6 and 12), made in a setup likewise."""
    from runs import two_ranks

    return two_ranks(conformance_dir, "ddp")


@pytest.fixture
def suite(conformance_dir: Path, strategy: str) -> Run:
    """The conformance suite's run of the test's `strategy` (on 2 ranks, or in the shape it declares), made once per
    session, in the setup of the first test that asks for it."""
    from runs import suite_run

    return suite_run(conformance_dir, strategy)


BUILD_OPS = """
import functools, cpuinfo  # asked twice per op, each answer a fresh Python process: once is enough (load_ops)
cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder
for builder in (ShareMemCommBuilder(), CPUAdamBuilder(), AsyncIOBuilder()):
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
"""


def pytest_configure(config: pytest.Config) -> None:
    """The session's start-up (pytest's, torch's and every test module's imports, the collected tests) is not
    scanned by the cycle collector as it grows (`launcher.base.process.hold_collector`, as the launcher's is)..."""
    from launcher.base.process import hold_collector

    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        hold_collector()  # a process that collects: not xdist's controller, which runs no test


def pytest_collection_finish(session: pytest.Session) -> None:
    """... and once collected, it is frozen out of the collector's reach for the rest of the session: a full
    collection in a test that runs in this process scans what the test makes, not the session's hundreds of
    thousands of objects (`release_collector`)."""
    from launcher.base.process import release_collector

    release_collector()
    _deepspeed_ops(session.items)


def _deepspeed_ops(items: list[pytest.Item]) -> None:
    """DeepSpeed's CPU ops (its shared-memory collectives, CPU Adam, and async I/O where libaio is installed) compiled
    once, before any test starts a run that loads them, as `.ci/run` does: a first compile inside a run would count
    against that run's timeout, and a compile killed there leaves torch's lock file for every later run to wait on.
    Compiled here, once collected and before the first test, not in a fixture: a fixture's setup counts against its
    test's own timeout (a short one cannot hold minutes of compile). Each test process asks; torch's own lock lets one
    compile while the others wait, and a compiled op just loads. A session of unit tests only (`-m unit`) starts no
    run, and so compiles nothing."""
    if all(item.get_closest_marker("unit") is not None for item in items):
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-c", BUILD_OPS], env=env, capture_output=True, timeout=1500)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Two tiers: a test marked `unit` runs in this process (`python -m pytest -m unit`, for quick work); every other
    test is `integration` (real launches, worker processes)."""
    for item in items:
        if item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def unit_tests_start_no_python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `unit` test that starts a Python process (a launch, a worker, torchrun) fails, naming the command: the tier
    stays in-process. Other programs (a compiler DeepSpeed's checks call, mount) may run."""
    if request.node.get_closest_marker("unit") is None:
        return
    real = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kw):  # type: ignore[no-untyped-def]
        first = str(args if isinstance(args, (str, os.PathLike)) else args[0])
        if Path(first).name.startswith(("python", "launch", "torchrun")) or first == sys.executable:
            raise AssertionError(f"a unit test started a process: {args!r}; mark it integration (leave it unmarked)")
        real(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: each test runs 2-rank jobs, so about one test process per two CPUs, and at least two
    (a test spends much of its time starting processes and waiting on them)."""
    from launcher.base.machine import usable_cpus

    return max(2, usable_cpus() // 2)


def assert_each_restart_resumes_the_newest(run_dir: Path, out: str, every: int, restarts: int) -> None:
    """Each restart resumes from the newest checkpoint: the one its message names is at most `every` steps behind the
    last step the attempt before it logged, and the restarted group's first step is that checkpoint's step + 1 (a
    replay from an older checkpoint gives the same final losses, but not these)."""
    found = re.findall(r"restart (\d+) of the worker group: resuming from \S+ \(step (\d+),", out)
    assert [int(n) for n, _ in found] == list(range(1, restarts + 1)), out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for n, checkpoint in ((int(n), int(step)) for n, step in found):
        before = [r["step"] for r in records if r["restart"] == n - 1]
        after = [r["step"] for r in records if r["restart"] == n]
        assert before and before[-1] - every <= checkpoint <= before[-1], (n, checkpoint, before)
        assert after and after[0] == checkpoint + 1, (n, checkpoint, after)


def saved_gpt2(folder_root: Path, name: str, config: dict[str, Any]) -> Path:
    """A tiny random GPT-2 of `config` (seed 0), saved with save_pretrained under `folder_root/name` once per session,
    whichever test process asks first: what a user's local pretrained folder looks like."""
    folder = folder_root / name
    with open(folder_root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").exists():
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            GPT2LMHeadModel(GPT2Config(**config)).save_pretrained(str(folder))
    return folder


@dataclass
class Postgres:
    """A private PostgreSQL server of the test session, on 127.0.0.1: its port and its superuser's password (given to
    libpq in PGPASSWORD, never in a URL)."""

    port: int
    password: str

    def database(self, name: str) -> str:
        """A new empty database on the server; its URL (no password in it)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            password=self.password,
            dbname="postgres",
            autocommit=True,
        ) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}"')
            db.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"


@pytest.fixture(scope="session")
def postgres() -> Any:
    """Debian's PostgreSQL server, made by initdb in a temporary folder and started on a free loopback port (as the
    `postgres` user when the tests run as root: the server refuses root), password authentication; stopped and
    removed at the end of the session. The server is this process's child, started with a parent-death signal
    (setpriv --pdeathsig): a session killed before its teardown takes its server with it."""
    import glob
    import secrets
    import shutil
    import socket
    import tempfile
    import time

    try:
        import psycopg
    except ImportError:
        unavailable(
            "LAUNCH_TEST_REQUIRE_POSTGRES", "the psycopg driver is not installed (pip install 'launch[postgres]')"
        )
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = found[-1] if found else shutil.which("initdb")
    if initdb is None:
        unavailable("LAUNCH_TEST_REQUIRE_POSTGRES", "PostgreSQL's server is not installed (apt-get install postgresql)")
    as_user = ["--reuid=postgres", "--regid=postgres", "--init-groups"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="launch-pg-"))  # not under pytest's folder, which only root may enter
    password = secrets.token_hex(8)
    (folder / "pw").write_text(password)
    if as_user:
        shutil.chown(folder, "postgres")
        shutil.chown(folder / "pw", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = folder / "data"
    subprocess.run(
        [
            "setpriv",
            *as_user,
            initdb,
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "scram-sha-256",
            f"--pwfile={folder / 'pw'}",
        ],
        check=True,
        capture_output=True,
    )
    options = ["-p", str(port), "-k", str(folder), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
    with open(folder / "log", "w") as log:
        server = subprocess.Popen(
            [
                "setpriv",
                *as_user,
                "--pdeathsig=KILL",
                str(Path(initdb).with_name("postgres")),
                "-D",
                str(data),
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(600):  # ready within a minute, or its log says why not
            try:
                psycopg.connect(
                    host="127.0.0.1", port=port, user="postgres", password=password, dbname="postgres"
                ).close()
                break
            except psycopg.OperationalError:
                if server.poll() is not None:
                    raise RuntimeError(f"PostgreSQL did not start: {(folder / 'log').read_text()[-500:]}") from None
                time.sleep(0.1)
        else:
            raise RuntimeError(f"PostgreSQL not ready after a minute: {(folder / 'log').read_text()[-500:]}")
        yield Postgres(port, password)
    finally:
        server.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown: its clients disconnected
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def etcd_server(v2: bool = True) -> Iterator[str]:
    """Debian's etcd server, its data in a temporary folder, on free loopback ports, with its v2 API on (the one
    torch's etcd rendezvous speaks) unless `v2` is False; its client address (HOST:PORT). The server is this process's
    child, started with a parent-death signal: a session killed before its teardown takes its server with it."""
    import shutil
    import socket
    import tempfile
    import time
    import urllib.request

    try:
        import etcd as _client  # noqa: F401
    except ImportError:
        unavailable("LAUNCH_TEST_REQUIRE_ETCD", "the python-etcd client is not installed (pip install 'launch[etcd]')")
    server_binary = shutil.which("etcd")
    if server_binary is None:
        unavailable("LAUNCH_TEST_REQUIRE_ETCD", "etcd's server is not installed (apt-get install etcd-server)")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client, peer = (f"http://127.0.0.1:{p}" for p in ports)
    folder = Path(tempfile.mkdtemp(prefix="launch-etcd-"))
    argv = [
        "setpriv",
        "--pdeathsig=KILL",
        server_binary,
        "--name=tests",
        f"--data-dir={folder / 'data'}",
        f"--enable-v2={str(v2).lower()}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tests={peer}",
    ]
    with open(folder / "log", "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        for _ in range(600):  # ready within a minute, or its log says why not
            try:
                direct.open(f"{client}/version", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"etcd did not start: {(folder / 'log').read_text()[-500:]}") from None
                time.sleep(0.1)
        else:
            raise RuntimeError(f"etcd not ready after a minute: {(folder / 'log').read_text()[-500:]}")
        yield f"127.0.0.1:{ports[0]}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd() -> Iterator[str]:
    """An etcd server of the test session, its v2 API on (`etcd_server`): its client address."""
    with etcd_server() as endpoint:
        yield endpoint
