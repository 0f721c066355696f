"""What the launcher says when workers fail: one line per failing rank, the root cause first, and the kernel's
out-of-memory killer named when it was the one that killed a worker.

A worker that raises writes its own line (`lifecycle.report_failure`: where in the run, the exception, the path of
its traceback) into the error file the elastic agent collects; a worker killed by a signal writes nothing, and then
the launcher looks at the out-of-memory kill counters of its cgroup and of the kernel (`memory.events` or
`memory.oom_control`, and `/proc/vmstat`): a rise during the run means the kernel killed it for memory.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.base.errors import REFUSED
from launcher.base.machine import memory_cgroups


def _cgroup_files() -> list[Path]:
    """This process's memory cgroup counters: v2 `memory.events`, or v1 `memory.oom_control`."""
    return [f for d in memory_cgroups() for f in (d / "memory.events", d / "memory.oom_control") if f.is_file()]


def oom_kills() -> int:
    """Out-of-memory kills so far, counted by this process's cgroup and by the kernel as a whole."""
    total = 0
    for file in [*_cgroup_files(), Path("/proc/vmstat")]:
        try:
            match = re.search(r"^oom_kill (\d+)$", file.read_text(), re.M)
        except OSError:
            continue
        total += int(match.group(1)) if match else 0
    return total


def rank_lines(
    error: Any, oom_before: int, advice: Callable[[], str] = str, spare: Path | None = None, run_dir: Path | None = None
) -> list[str]:
    """One line per failing rank of a ChildFailedError, the first failure first, ranks that failed alike in one line;
    `advice` (what would fit in memory) is asked for only when the out-of-memory killer is named. A report a worker
    could not write where the agent reads it (a full disk) is read from `spare`, the launcher's own folder. A rank
    killed by a signal is said with where it was (`killed_where`, from `run_dir`'s logs)."""
    _add_unlisted(error.failures, spare)
    for rank, failure in error.failures.items():
        _read_spare(failure, spare / f"rank{rank}.json" if spare else None)
    ranks = sorted(error.failures, key=lambda r: _order(r, error.failures[r]))
    oom = oom_kills() > oom_before
    lines = _merged([_line(rank, error.failures[rank], oom, run_dir) for rank in ranks])
    if any(OOM in line for line in lines):
        note = advice()
        lines = [f"{line}: {note}" if OOM in line and note else line for line in lines]
    return lines


OOM = "was killed by the out-of-memory killer"


def _add_unlisted(failures: dict[int, Any], spare: Path | None) -> None:
    """The agent of forked workers (torch's multiprocessing context) lists its first failing rank only: this node's
    other ranks that failed too are found by their own reports, beside that rank's (`<attempt>/<local rank>/`) or in
    the spare folder."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for rank, failure in list(failures.items()):
        folder, offset = Path(failure.error_file).parent, rank - failure.local_rank
        found = folder.parent.glob("*/error.json") if folder.name == str(failure.local_rank) else []  # the agent's
        reports = {int(f.parent.name) + offset: f for f in found if f.parent.name.isdigit()}
        for file in spare.glob("rank*.json") if spare else []:
            if (number := file.stem.removeprefix("rank")).isdigit():
                reports.setdefault(int(number), file)
        for other, report in reports.items():
            if other not in failures and other - offset >= 0:
                failures[other] = ProcessFailure(other - offset, 0, 1, str(report))


def _read_spare(failure: Any, file: Path | None) -> None:
    """The worker's report from the spare folder, where the agent found none of its own."""
    if file is None or failure.error_file_data.get("message") not in (None, "<NONE>") or not file.is_file():
        return  # torch's own placeholder for no report: {"message": "<NONE>"}
    try:
        record = json.loads(file.read_text())
        failure.error_file_data, failure.message = record, record["message"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        pass


def _rank_order(item: tuple[str, str]) -> tuple[int, str]:
    return (int(item[0]), "") if item[0].isdigit() else (1 << 30, item[0])


def _merged(lines: list[str]) -> list[str]:
    """Ranks that failed with the same words (every rank hits the same full disk) in one line: `ranks 0, 1 ...`,
    their tracebacks' paths as `rank<N>.traceback`; a refusal every rank made alike (no rank in it), once."""
    ranks: dict[str, list[tuple[str, str]]] = {}
    told = [line for n, line in enumerate(lines) if not line.startswith("rank ") and line not in lines[:n]]
    for line in (line for line in lines if line.startswith("rank ")):
        rank, _, rest = line.removeprefix("rank ").partition(" ")
        key = rest.replace(f"/rank{rank}.traceback)", "/rank<N>.traceback)")
        ranks.setdefault(key, []).append((rank, rest))
    return told + [
        f"rank {alike[0][0]} {alike[0][1]}"
        if len(alike) == 1
        else f"ranks {', '.join(r for r, _ in sorted(alike, key=_rank_order))} {re.sub(r'^was ', 'were ', key)}"
        for key, alike in ranks.items()
    ]


STOPPED_BY_LAUNCHER: set[int] = set()
"""Workers of this attempt that the launcher's agent stopped (SIGTERM) or killed because another failed
(`launcher.elastic.agent.Agent`): not failures of their own."""
SECONDARY = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")
"""What a rank says (gloo, NCCL, a socket) when another one died first: it is not the cause."""
ECHO = "lost its peers"
STOPPED = "was stopped by the launcher"


def secondary(line: str) -> bool:
    """A rank's line that says a peer was gone, not why, or that the launcher stopped it."""
    return (
        any(s in line.lower() for s in SECONDARY)
        or ECHO in line
        or STOPPED in line
        or line.endswith("was killed by SIGTERM")
    )


def peer_failure(run_dir: Path, since: float) -> str | None:
    """The cause another node's rank reported, for a node whose own ranks only stopped with it: the earliest error
    file since `since` in the shared run directory's `logs/` (the agents' `<id>/attempt_<n>/<local rank>/error.json`)
    whose line is a cause, not an echo, naming its rank (by its traceback's file) and that rank's node, or a refusal
    every rank made alike (in its own words); None if there is none (a node that went away reported nothing). The
    files are read as data: a line, never more."""
    found: list[tuple[float, int, str]] = []
    for file in (run_dir / "logs").glob("*/attempt_*/*/error.json"):
        try:
            written = file.stat().st_mtime
            line = json.loads(file.read_text())["message"]["message"] if written >= since else None
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(line, str) or secondary(line):
            continue
        if line.startswith(REFUSED):  # a check every rank made alike: its own words
            found.append((written, -1, " ".join(line.removeprefix(REFUSED).split())[:1000]))
        elif m := re.search(r"[/\\]rank(\d+)\.traceback\)$", line):
            found.append((written, int(m.group(1)), " ".join(line.split())[:1000]))
    if not found:
        return None
    _, rank, line = min(found)
    if rank < 0:
        return line
    try:
        record = json.loads((run_dir / "logs" / "ranks" / f"rank{rank}.json").read_text())
        where = f" (node {int(record['node'])}, {str(record['host'])[:100]})"
    except (OSError, ValueError, KeyError, TypeError):
        where = ""
    return f"rank {rank}{where} failed {line}; this node's ranks stopped with it"


CAUSE_WAIT_S = 5.0
"""Seconds a node whose ranks only lost their peers waits for the cause (another node's rank's report) to be on file
before it names a node gone instead."""


def awaited_cause(run_dir: Path, since: float, wait_s: float = CAUSE_WAIT_S) -> str | None:
    """`peer_failure`, asked again for up to `wait_s` seconds while it finds none. Another node's rank that failed
    wrote its report before it exited, but this node can hear of the failure first (a shared file system shows the
    file late, or half written): a node is named gone only once no cause came in that time."""
    deadline = time.monotonic() + wait_s
    while (cause := peer_failure(run_dir, since)) is None and time.monotonic() < deadline:
        time.sleep(0.25)
    return cause


def _joined(run_dir: Path, since: float) -> dict[int, dict[str, Any]]:
    """The ranks' `logs/ranks/` records (`lifecycle.joined`) written since `since`, by rank; damaged ones left out."""
    records: dict[int, dict[str, Any]] = {}
    for file in (run_dir / "logs" / "ranks").glob("rank*.json"):
        try:
            record = json.loads(file.read_text()) if file.stat().st_mtime >= since else None
            if isinstance(record, dict):
                records[int(file.stem.removeprefix("rank"))] = record
        except (OSError, ValueError):
            continue
    return records


def joined_here(run_dir: Path, since: float, me: str) -> bool:
    """Whether a rank of this node's launcher (`me`) joined the process group since `since` (its `logs/ranks/`
    record): a rendezvous error after it is a store lost while the job ran, not nodes that never came."""
    return any(record.get("launcher") == me for record in _joined(run_dir, since).values())


def lost_node(
    run_dir: Path, since: float, world_size: int, me: str, store_gone: str | None = None, elastic: bool = False
) -> str | None:
    """One line naming the node that went away after every rank had joined (the ranks' `logs/ranks/` records
    since `since`), and where its ranks were last (their phase files: the stalest node is the one gone), and what to
    do: `store_gone`, the rendezvous endpoint where nothing answers any more (the node that went away hosted the
    rendezvous store, which no job outlives, elastic or not); None if the group never joined whole, or no other node's
    rank is known."""
    records = _joined(run_dir, since)
    others: dict[int, list[int]] = {}
    for rank, record in sorted(records.items()):
        if record.get("launcher") != me:
            others.setdefault(int(record.get("node", -1)), []).append(rank)
    if len(records) < world_size or not others:
        return None
    phases = run_dir / "logs" / "phase"

    def heard(rank: int) -> float:
        try:
            return (phases / f"rank{rank}").stat().st_mtime
        except OSError:
            return 0.0

    node, ranks = min(others.items(), key=lambda item: max(heard(r) for r in item[1]))
    what = _read(phases / f"rank{ranks[0]}").partition(" ")[2] or "unknown"
    # The lost rank's phase can be older than the group's (it is written every 2 s): the group was at the newest
    # step that any rank's phase names, the ranks being in lockstep.
    steps = [int(m.group(1)) for r in records if (m := re.search(r"step (\d+)", _read(phases / f"rank{r}")))]
    where = f"at step {max(steps)}" if steps else f"while {what}"
    gone = (
        f"node {node} ({records[ranks[0]].get('host')}; rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}) went away {where}: rank {ranks[0]} was last {what}"
    )
    if store_gone:
        return (
            f"{gone}; it hosted the rendezvous (rdzv.endpoint={store_gone}), whose store no job outlives"
            f"{', elastic or not' if elastic else ''}: the job stopped (each node's lines are in <run dir>/logs/"
            "agent.log); start launch again on every node, with rdzv.endpoint on a node that is up, to resume from "
            "the last checkpoint"
        )
    return (
        f"{gone}; the job stopped without it (each node's lines are in <run dir>/logs/agent.log); start launch again "
        "on every node to resume, or make the job elastic to go on without a node that leaves (nodes=MIN:MAX with "
        "trainer.max_restarts=N)"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _order(rank: int, failure: Any) -> tuple[int, float, int]:
    """Root causes first: a rank that raised for its own reason, or died of a signal other than the agent's
    SIGTERM (the out-of-memory killer, a crash); then ranks that failed because a peer was gone; then ranks the
    agent stopped. Ties by time (to the microsecond where the worker wrote it: torch's timestamp is in seconds)."""
    if failure.pid in STOPPED_BY_LAUNCHER:
        return 3, float(failure.timestamp), rank
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    precise = message.get("extraInfo", {}).get("time") if isinstance(message, dict) else None
    text = str(message.get("message", "") if isinstance(message, dict) else message or "").lower()
    if precise is not None:
        return (2 if any(s in text for s in SECONDARY) else 0), float(precise), rank
    return (3 if failure.exitcode == -signal.SIGTERM else 1), float(failure.timestamp), rank


def _line(rank: int, failure: Any, oom: bool, run_dir: Path | None = None) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if text.startswith(REFUSED):  # a check every rank made alike: its own words, once (`_merged`)
        return text.removeprefix(REFUSED)
    if text.startswith("while ") and any(s in text.lower() for s in SECONDARY):
        # The collective library's words for a peer that is gone (gloo's "Connection closed by peer ... GLHF!"):
        # an echo of another rank's failure, told without them.
        return f"rank {rank} {ECHO} {text.partition(': ')[0]} (another rank ended first)"
    if text.startswith("while "):  # the worker's own line (lifecycle.report_failure)
        return f"rank {rank} failed {text}"
    code = failure.exitcode
    if failure.pid in STOPPED_BY_LAUNCHER:
        return f"rank {rank} {STOPPED} (another rank failed first)"
    if code == -signal.SIGKILL and oom:
        return f"rank {rank} {OOM}"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        # SIGTERM is the agent's stop of a rank whose peer failed (`secondary`): where it was says nothing more.
        where = killed_where(run_dir, rank) if run_dir and code != -signal.SIGTERM else ""
        return f"rank {rank} was killed by {name}{where}"
    return f"rank {rank} failed: {_summary(text, code)}"


def killed_where(run_dir: Path, rank: int) -> str:
    """Where a rank that a signal killed was: the collective it was in (from the stacks faulthandler wrote into
    `logs/stacks/rank<N>` as it died; a SIGKILL leaves none), and its phase, or the newest phase of the group's when
    its own report (written every 2 s) is older; "" when no rank left either."""
    collective = _fatal_collective(_read(run_dir / "logs" / "stacks" / f"rank{rank}"))
    phases = {}
    for file in (run_dir / "logs" / "phase").glob("rank*"):
        stamp, _, what = _read(file).partition(" ")
        if file.name.removeprefix("rank").isdigit() and what:
            try:
                phases[int(file.name.removeprefix("rank"))] = (float(stamp), what)
            except ValueError:
                continue
    own = phases.get(rank)
    newest = max(phases.items(), key=lambda item: item[1][0], default=None)
    if newest is None:
        where = ""
    elif own is not None and (newest[0] == rank or newest[1][1] == own[1]):
        where = f" while {own[1]}"
    else:
        last = f"rank {rank}'s own last report, written every 2 s, said {own[1]}" if own else f"rank {rank} wrote none"
        where = f" while the group was {newest[1][1]} (rank {newest[0]}'s phase; {last})"
    stacks = f" (its stacks: {run_dir / 'logs' / 'stacks' / f'rank{rank}'})" if collective else ""
    return (f" in {collective}" if collective else "") + where + stacks


C10D = "torch/distributed/distributed_c10d.py"


def _fatal_collective(dump: str) -> str | None:
    """The collective of torch.distributed that the last fatal-error dump of faulthandler shows a thread in, the
    signalled thread's first, and who called it: `torch.distributed.reduce, called from
    deepspeed/runtime/zero/stage_1_and_2.py (allreduce_bucket)`."""
    fatal = dump.rpartition("Fatal Python error")[2]
    if not fatal:
        return None
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", fatal)
    threads.sort(key=lambda block: not block.startswith("Current thread"))
    for block in threads:
        frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', block)  # most recent call first
        inside = next((i for i, (path, _) in enumerate(frames) if path.endswith(C10D)), None)
        if inside is None:
            continue
        name = f"torch.distributed.{frames[inside][1]}"
        caller = next(((p, f) for p, f in frames[inside + 1 :] if not _plumbing(p, f)), None)
        if caller is None:
            return name
        path = caller[0].rpartition("site-packages/")[2]
        return f"{name}, called from {path} ({caller[1]})"
    return None


def _plumbing(path: str, function: str) -> bool:
    """A frame between a collective and the code that asked for it: torch's own, DeepSpeed's comm layer, a wrapper."""
    return "/torch/" in path or "/deepspeed/comm/" in path or function == "wrapper"


def _summary(message: str, exitcode: int) -> str:
    """The line of an error that names the exception, or the exit code."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if named or lines:
        return (named or lines)[-1]
    return f"exit code {exitcode}"
