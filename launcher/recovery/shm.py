"""The memory tier of checkpoints, on one node: what its folder in shared memory holds, which step is complete across
the nodes that survive, and the promotion of that step to a normal checkpoint (`launcher.checkpoint.format`).

A node's folder (`TIER_ENV`, made and removed by the node's launcher, named by the run id and the launcher's own
identity, which outlives every restart of its worker group) holds:
    step_00000036/    the files of a checkpoint of step 36 (DCP's `__<rank>_0.distcp`, `rng_<rank>.pt`, and rank 0's
                      `.metadata`) of this node's ranks and of the ranks whose replicas it keeps, and one
                      `rank<R>.json` per rank whose files are all there (written after them): its files' sizes and
                      checksums; rank 0's also the position and the manifest's fields
    last              the last step a rank of this node trained and when (`step time`): what a restart replays
A step is complete when every rank of the world that saved it has its marker on some node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.base.storage import Location, write_file
from launcher.config import ConfigError

TIER_ENV = "LAUNCH_MEMORY_TIER"
"""This node's folder in shared memory, set by its launcher for its workers."""
SHM_ENV = "LAUNCH_SHM"
SHM = Path(os.environ.get(SHM_ENV) or "/dev/shm")
"""Where the memory tier keeps each node's state, and the launcher its failure reports when the run directory cannot
hold them: /dev/shm, or the memory-backed folder $LAUNCH_SHM names (a container's /dev/shm is 64 MB unless it is
given more: mount a larger tmpfs and name it here, the same on every node)."""
PREFIX = "launch-tier-"
LAST = "last"
_STEP = re.compile(r"step_(\d{8})")
_MARKER = re.compile(r"rank(\d+)\.json")


def node_folder(run_id: str, node: str) -> Path:
    """This node's folder: the run's id and the node's launcher (`host:pid:...`), in shared memory."""
    host, pid = (node.split(":") + ["", ""])[:2]
    return SHM / f"{PREFIX}{run_id}-{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}-{pid}"


def step_folder(tier: Path, step: int) -> Path:
    return tier / f"step_{step:08d}"


def marker_name(rank: int) -> str:
    return f"rank{rank}.json"


def put(tier: Path, step: int, files: dict[str, Any], marker: dict[str, Any]) -> None:
    """A rank's files of `step` (bytes, or arrays of them) into this node's folder, then its marker (atomically):
    from then on they count."""
    folder = step_folder(tier, step)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(memoryview(data))
    partial = folder / f".{marker_name(marker['rank'])}.partial"
    partial.write_text(json.dumps(marker))
    os.replace(partial, folder / marker_name(marker["rank"]))


def mark_last(tier: Path, step: int, when: float) -> None:
    """The last step this node trained, and when (a few bytes in memory, every step)."""
    partial = tier / f".{LAST}.partial"
    partial.write_text(f"{step} {when:.3f}")
    os.replace(partial, tier / LAST)


def held(tier: Path) -> dict[str, Any]:
    """What this node's folder holds: {"steps": {step: {rank: marker}}, "last": [step, time] or None}."""
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for folder in sorted(tier.glob("step_*")) if tier.is_dir() else []:
        if not (m := _STEP.fullmatch(folder.name)):
            continue
        for file in folder.glob("rank*.json"):
            if (r := _MARKER.fullmatch(file.name)) is None:
                continue
            try:
                marker = json.loads(file.read_text())
            except (OSError, ValueError):
                continue
            if _intact(folder, marker):
                steps.setdefault(int(m.group(1)), {})[int(r.group(1))] = marker
    last = None
    try:
        step, when = (tier / LAST).read_text().split()
        last = [int(step), float(when)]
    except (OSError, ValueError):
        pass
    return {"steps": steps, "last": last}


def _intact(folder: Path, marker: dict[str, Any]) -> bool:
    try:
        return all((folder / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def choose(views: dict[str, dict[str, Any]]) -> tuple[int | None, dict[str, str], str]:
    """From each surviving node's `held` (by node): the newest step whose every rank's files are on some node, and
    which node gives each rank's files (its own where it holds them); else None and why, in words."""
    steps = sorted({s for view in views.values() for s in view["steps"]}, reverse=True)
    why = "no node holds a step" if not steps else ""
    for step in steps:
        if whole := whole_marker(views, step):  # a replica's whole state (`launcher.recovery.replicas`)
            return step, {str(whole[1]["rank"]): whole[0]}, ""
        holders: dict[int, str] = {}
        world = None
        for node, view in sorted(views.items()):
            for rank, marker in view["steps"].get(step, {}).items():
                if rank not in holders or marker.get("node") == node:  # a rank's own node first
                    holders[rank] = node
                world = int(marker["world_size"])
        missing = sorted(set(range(world or 0)) - set(holders))
        if world and not missing:
            return step, {str(r): n for r, n in holders.items()}, ""
        if not why:
            lost = ", ".join(map(str, missing[:4])) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            why = f"step {step} lacks the state of rank{'s' if len(missing) > 1 else ''} {lost} on every node left"
    return None, {}, why


def whole_marker(views: dict[str, dict[str, Any]], step: int) -> tuple[str, dict[str, Any]] | None:
    """(node, marker) of the lowest rank that wrote the whole state of `step` on a node left, if any did."""
    found = [(int(r), node, m) for node, view in sorted(views.items()) for r, m in view["steps"].get(step, {}).items()]
    whole = sorted((r, node, m) for r, node, m in found if m.get("whole"))
    return (whole[0][1], whole[0][2]) if whole else None


def last_trained(views: dict[str, dict[str, Any]]) -> tuple[int, float] | None:
    """The last step any surviving node trained, and the latest time one did (when the failure came, within a
    step)."""
    lasts = [view["last"] for view in views.values() if view["last"]]
    if not lasts:
        return None
    return max(int(s) for s, _ in lasts), max(float(t) for _, t in lasts)


def copy_out(tier: Path, step: int, ranks: list[int], target: Location) -> None:
    """The files of `ranks` at `step`, from this node's folder into the checkpoint folder being written (a local
    folder or a URL)."""
    folder = step_folder(tier, step)
    for rank in ranks:
        marker = json.loads((folder / marker_name(rank)).read_text())
        for name in marker["files"]:
            write_file(target / name, (folder / name).read_bytes())


def clear(tier: Path, keep: set[int] | None = None) -> None:
    """The steps of this node's folder removed, but those in `keep`."""
    for folder in tier.glob("step_*") if tier.is_dir() else []:
        if (m := _STEP.fullmatch(folder.name)) and int(m.group(1)) not in (keep or set()):
            shutil.rmtree(folder, ignore_errors=True)


def tier_bytes(job_bytes: int, replicas: int, nodes: int, whole: bool = False) -> int:
    """Host memory a node's folder takes at its fullest: two steps of its share of the job's checkpoint (`job_bytes`,
    each tensor once, spread over the nodes as DCP spreads the ranks' writes) and of its replicas'; where every rank
    holds the whole state (`whole`: ddp, `launcher.recovery.replicas`), that state once, written on a failure."""
    return job_bytes if whole else 2 * -(-job_bytes // nodes) * (1 + replicas)


def tier_need(trainer: Any, job_bytes: int, min_nodes: int, nodes: int, whole: bool = False) -> tuple[int, int, int]:
    """The host memory a node's folder takes at its fullest over the numbers of nodes the job may run at (`tier_bytes`
    with that number's replicas): its bytes, at how many nodes (the fewest, of those that need the most), with how
    many replicas."""
    sizes = {k: tier_bytes(job_bytes, replicas(trainer, k), k, whole) for k in range(min_nodes, nodes + 1)}
    at = max(sizes, key=lambda k: (sizes[k], -k))
    return sizes[at], at, replicas(trainer, at)


def tier_on(trainer: Any) -> bool:
    """Whether the run keeps a memory tier (trainer.memory_checkpoint_every above 0): the one place that says it."""
    return bool(int(trainer.get("memory_checkpoint_every", 0) or 0))


def replicas(trainer: DictConfig, nodes: int) -> int:
    """How many other nodes keep a copy of each node's files in a group of `nodes` nodes: trainer.memory_replicas, or
    by default 1; never more than the other nodes there are (none on one node; fewer where an elastic job runs at
    fewer nodes than it asks)."""
    wanted = trainer.get("memory_replicas")
    return min(max(nodes - 1, 0), 1 if wanted is None else int(wanted))


def check_memory_tier(
    trainer: DictConfig, nodes: int, min_nodes: int, job_bytes: int | None, whole: bool = False
) -> None:
    """The memory tier's settings against the job: the replicas asked for (the default takes what the nodes allow),
    and room in shared memory for two steps of a node's share of the job's state (`job_bytes`, if known) and its
    replicas', at whichever number of nodes the job may run at needs the most."""
    if not tier_on(trainer):
        return
    asked = trainer.get("memory_replicas")
    count = 0 if asked is None else int(asked)
    if count and nodes == 1:
        raise ConfigError(
            f"trainer.memory_replicas={count} on a single-node job: replicas go to other nodes; set "
            "trainer.memory_replicas=0 (the tier then survives a failed rank, not a lost node)"
        )
    if count >= min_nodes:
        fewest = f"nodes={min_nodes}:{nodes} may run on {min_nodes}" if min_nodes < nodes else f"nodes={nodes}"
        raise ConfigError(
            f"trainer.memory_replicas={count} needs more than {count} nodes, but {fewest}; set "
            f"trainer.memory_replicas to at most {min_nodes - 1}"
        )
    if job_bytes is None or not SHM.is_dir():
        return
    stat = os.statvfs(SHM)
    free = stat.f_bavail * stat.f_frsize
    need, at, count = tier_need(trainer, job_bytes, min_nodes, nodes, whole)
    if need > free and whole:
        raise ConfigError(
            f"the memory tier needs {need / 1e6:.1f} MB of shared memory on each node (the whole state, which every "
            f"rank holds, written once on a failure), but {SHM} has {free / 1e6:.1f} MB free; enlarge {SHM}, or set "
            "trainer.memory_checkpoint_every=0"
        )
    if need > free:
        raise ConfigError(
            f"the memory tier needs {need / 1e6:.1f} MB of shared memory on each node (2 steps x "
            f"{job_bytes / 1e6:.1f} MB of state / {at} node(s) x (1 + {count} replica(s))), but {SHM} has "
            f"{free / 1e6:.1f} MB free; enlarge {SHM}, lower trainer.memory_replicas, or set "
            "trainer.memory_checkpoint_every=0"
        )
