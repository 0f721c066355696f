"""Checkpoints: one strategy-neutral format, written collectively, atomically and durably.

Layout of `<run dir>/checkpoints/`:
    step_00000006/        .metadata + one .distcp per rank (torch.distributed.checkpoint), rng_<rank>.pt,
                          manifest.json (written last: step, samples, identity, and every file with its size and its
                          xxh3-128 checksum, computed as the bytes were written)
    latest                the name of the newest complete checkpoint, moved after the rename (for people and
                          tools: the launcher orders checkpoints by their manifests' times)

Model and optimizer state are whatever `strategy.state_dict()` returns: torch's state-dict shape keyed by
parameter names (plain tensors for replicated strategies, DTensor shards for FSDP, full tensors exported by
DeepSpeed). DCP stores each tensor once and re-slices it on load, so any checkpoint loads under any strategy
and world size. Everything read back goes through `launcher.untrusted`: a checkpoint is data, never code.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.untrusted import UntrustedDataError, dcp_load, read_manifest, read_metadata

LATEST = "latest"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: its message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Position:
    """Where training stands: the next optimizer step is `step + 1`."""

    step: int
    samples: int
    """Global sample index: samples consumed so far (the data order resumes from here)."""


# ------------------------------------------------------------------ finding checkpoints


def is_complete(path: Path) -> bool:
    """A checkpoint whose manifest parses and whose every listed file is there, at its recorded size (cheap: no file
    is read; `damage` also verifies the contents)."""
    try:
        files = read_manifest(path)["files"]
    except UntrustedDataError:
        return False
    try:
        return bool(files) and all((path / name).stat().st_size == size for name, size in files.items())
    except OSError:
        return False


def by_time(checkpoints: Path) -> list[Path]:
    """The checkpoints under `checkpoints/` whose manifests parse, newest first: by the time each manifest records,
    then by step. Not by the `latest` pointer, which is moved last: a save killed between its rename and the
    pointer's move is the newest. Not by step alone: a run resumed from further back saves steps older than ones
    already there, and those it saves are the newer. The one order of checkpoints: resume and pruning both use it."""
    found = []
    for path in checkpoints.glob("step_*"):
        try:
            found.append((float(read_manifest(path)["time"]), path.name, path))
        except UntrustedDataError:
            continue
    return [path for *_, path in sorted(found, reverse=True)]


def complete(checkpoints: Path) -> list[Path]:
    """The complete checkpoints under `checkpoints/`, newest first (`by_time`)."""
    return [path for path in by_time(checkpoints) if is_complete(path)]


def latest(checkpoints: Path) -> Path | None:
    found = complete(checkpoints)
    return found[0] if found else None


CHUNK = 8 << 20


def checksum(path: Path) -> str:
    """The xxh3-128 checksum of a file's bytes, as `launcher.saving` records it while writing."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used, naming the file: an unreadable manifest, a file missing,
    truncated (its recorded and actual sizes) or unreadable, or whose bytes fail the checksum its manifest records.
    None when every file verifies. Reads every file once."""
    try:
        manifest = read_manifest(path)
    except UntrustedDataError as e:
        return str(e)
    for name, size in manifest["files"].items():
        file = path / name
        try:
            actual = file.stat().st_size
            if actual != size:
                return (
                    f"{name} is truncated: {size} bytes recorded, {actual} on disk"
                    if actual < size
                    else (f"{name} has {actual} bytes, {size} recorded")
                )
            if checksum(file) != manifest["xxh3_128"][name]:
                return f"{name} fails its checksum (xxh3-128): its bytes changed after they were written"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror or type(e).__name__})"
    return None


def skipped(path: Path, why: str) -> str:
    """The line a fallback prints."""
    return f"launch: skipping checkpoint {path}: {why}"


def newest_intact(checkpoints: Path, say: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under `checkpoints/` (`by_time`) that verifies (`damage`); `say` is told one line for
    each newer one skipped, and for each folder whose manifest does not parse."""
    ordered = by_time(checkpoints)
    for broken in sorted(set(checkpoints.glob("step_*")) - set(ordered)):
        say(skipped(broken, damage(broken) or "its manifest does not parse"))
    for path in ordered:
        why = damage(path)
        if why is None:
            return path
        say(skipped(path, why))
    return None


def intact(path: Path) -> Path:
    """`path` if the checkpoint there verifies; else CheckpointError, the line that names the file and why."""
    why = damage(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {why}; resume from another one")
    return path


def find_resume(resume: str | None, run_dir: Path, identity: dict[str, Any]) -> Path | None:
    """Resolve `resume=` (None, auto, a run directory or a checkpoint directory) to a checkpoint.

    `auto` takes the newest checkpoint of an earlier run of the same identity (`identity["config_hash"]`; in a
    sweep also the same overrides, and never a sibling job of this sweep), owned by this user.
    """
    if resume is None:
        return None
    if resume == "auto":
        return _auto(run_dir, identity)
    path = Path(resume).expanduser()
    if (path / MANIFEST).exists():  # a checkpoint folder: this one or none
        return intact(path)
    found = newest_intact(path / "checkpoints") if path.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"resume={resume}: no complete checkpoint there; give a run directory or a checkpoints/step_* folder"
        )
    return found


def _auto(run_dir: Path, identity: dict[str, Any]) -> Path | None:
    roots = [run_dir.parent, run_dir.parent.parent]
    sweep = identity.get("sweep_dir")
    seen: dict[Path, float] = {}
    folders = {
        f.resolve() for root in roots for pattern in ("*/checkpoints", "*/*/checkpoints") for f in root.glob(pattern)
    }
    for folder in sorted(folders):
        owner = folder.parent
        if owner == run_dir.resolve() or (sweep and owner.parent == Path(sweep).resolve()):
            continue  # this run's own checkpoints resume by themselves; a sibling job of this sweep is another run
        for path in sorted(folder.glob("step_*"), reverse=True):  # the run's newest usable checkpoint
            try:
                manifest = read_manifest(path)
            except UntrustedDataError as e:
                print(f"launch: resume=auto: skipping {path}: {e}")
                continue
            if not is_complete(path):
                continue
            mine = path.stat().st_uid == os.getuid() and manifest["config_hash"] == identity["config_hash"]
            if mine and manifest.get("overrides") == identity.get("overrides"):
                seen[path] = float(manifest["time"])
            break
    found = max(seen, key=seen.__getitem__, default=None)
    return newest_intact(found.parent) if found is not None else None


def check_fits(checkpoint: Path, model: Any) -> None:
    """Compare the checkpoint's model tensors with a model built on the meta device, and read every non-tensor
    entry as the workers will: CheckpointError (one line) names a mismatch or an entry that is not plain data."""
    try:
        metadata = read_metadata(checkpoint)
    except UntrustedDataError as e:
        raise CheckpointError(f"{e}; resume from another one") from e
    _check_plain(checkpoint, metadata.state_dict_metadata)
    stored = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in stored:
            raise CheckpointError(
                f"checkpoint {checkpoint} has no tensor {name} of the model; resume with the model it was saved from"
            )
        if stored[name] != shape:
            raise CheckpointError(
                f"checkpoint {checkpoint} does not fit the model: {name} is {list(stored[name])} there, "
                f"{list(shape)} here; resume with the model settings it was saved with"
            )


def _check_plain(checkpoint: Path, entries: dict[str, Any]) -> None:
    """Read every non-tensor entry in this process (no process group); CheckpointError if one is not plain data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    plain = {k: None for k, v in entries.items() if isinstance(v, BytesStorageMetadata)}  # flat keys: DCP's names
    try:
        dcp_load(plain, checkpoint, no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:  # DCP's exception is a BaseException
        reason = next((line for line in str(e).splitlines() if "GLOBAL" in line), type(e).__name__).strip()
        raise CheckpointError(
            f"checkpoint {checkpoint} holds an entry that is not plain data ({reason}); "
            "resume only from checkpoints launch wrote"
        ) from e


# ------------------------------------------------------------------ saving


def remove_partial(checkpoints: Path) -> None:
    """Folders of saves that never finished (a kill, a crash): no complete checkpoint is among them."""
    for stale in checkpoints.glob(".step_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def load(checkpoint: Path, manifest: dict[str, Any], strategy: Any, rank: int, world_size: int) -> Position:
    """Load model and optimizer state into the strategy (collective); restore RNG when the world size is unchanged.

    `manifest` is rank 0's reading of the checkpoint's manifest (`read_manifest`), the same on every rank."""
    import torch

    state = strategy.state_dict()  # the template: this strategy's layout, filled in place from any layout
    read_into(state, checkpoint)
    strategy.load_state_dict(state)
    rng = checkpoint / f"rng_{rank}.pt"
    if manifest["world_size"] == world_size and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    return Position(step=manifest["step"], samples=manifest["samples"])


def read_into(state: dict[str, Any], checkpoint: Path) -> None:
    """Fill `state` (a strategy's state dict: model, optim) in place from a checkpoint of any layout (collective)."""
    stored = set(read_metadata(checkpoint).state_dict_metadata)
    # Optimizers name their hyperparameters differently (torch's AdamW has `maximize`, DeepSpeed's
    # CPU Adam `bias_correction`): those the checkpoint lacks keep this run's values.
    groups = state.get("optim", {}).get("param_groups", [])
    own = [
        {k: g.pop(k) for k in list(g) if k != "params" and f"optim.param_groups.{i}.{k}" not in stored}
        for i, g in enumerate(groups)
    ]
    dcp_load(state, checkpoint)
    for group, values in zip(groups, own, strict=True):
        group.update(values)


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
