"""The checkpoint format, written once: what a checkpoint folder holds, what makes it complete, which is newest.

Layout of `<run dir>/checkpoints/` (or trainer.checkpoint_dir: a local folder or a URL, `launcher.base.storage`):
    step_00000006/        .metadata + one .distcp per rank (torch.distributed.checkpoint), rng_<rank>.pt,
                          manifest.json (written last: step, samples, identity, run id (`launcher.parent.run_id`), and
                          every file with its size and its xxh3-128 checksum, computed as the bytes were written)
    .step_00000008.partial/   a save still being written, or one that never finished: never read
    latest                the name of the newest complete checkpoint, moved after the rename (for people and
                          tools: the launcher orders checkpoints by their manifests' times, `by_time`)

In object storage there is no atomic rename: a save is written in place, `step_N/`, and is partial until its
manifest, written last, is there (`is_partial`); the rest is the same.

Model and optimizer state are whatever `strategy.state_dict()` returns: torch's state-dict shape keyed by
parameter names (plain tensors for replicated strategies, DTensor shards for FSDP, full tensors exported by
DeepSpeed). DCP stores each tensor once and re-slices it on load, so any checkpoint loads under any strategy
and world size. Manifests are JSON, checked field by field here (`read_manifest`); the rest of what is read back
goes through `launcher.checkpoint.untrusted`: a checkpoint is data, never code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.base import storage
from launcher.base.hashing import checksum
from launcher.base.storage import Location, is_remote
from launcher.checkpoint.untrusted import UntrustedDataError

LATEST = "latest"
BEST = "best"
"""The pointer to trainer.early_stop's best checkpoint, beside `latest`."""
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a run id may be (`launcher.parent.run_id`; wandb's own are 8 base-36 digits, one written by hand any such name):
in a manifest's `run_id` and in a run directory's `run_id` file."""
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: its message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Position:
    """Where training stands: the next optimizer step is `step + 1`."""

    step: int
    samples: int
    """Global sample index: samples consumed so far (the data order resumes from here)."""
    stream: dict[str, Any] | None = None
    """A stream's own state after those samples (its `state_dict`, plain JSON), where it keeps one
    (`launcher.data.sources`): a resume loads it instead of reading past the samples again."""


def folder_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_name(step: int) -> str:
    return f".{folder_name(step)}.partial"


def rng_name(rank: int) -> str:
    return f"rng_{rank}.pt"


def writing_folder(checkpoints: Location, step: int) -> Location:
    """Where the save of `step` is written: locally `.step_N.partial`, renamed into place once complete; in object
    storage (no atomic rename) `step_N` itself, complete once its manifest, written last, is there."""
    return checkpoints / (folder_name(step) if is_remote(checkpoints) else partial_name(step))


def is_partial(path: Location) -> bool:
    """A save that is being written or never finished: never read, never listed as a checkpoint."""
    if is_remote(path):
        return path.name.startswith("step_") and not (path / MANIFEST).exists()
    return path.name.startswith(".step_") and path.name.endswith(".partial")


def remove(folder: Location) -> None:
    """A checkpoint folder removed (in object storage its manifest first: what is left is partial)."""
    storage.remove(folder, first=MANIFEST)


# ------------------------------------------------------------------ manifests

_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "samples": int,
    "world_size": int,
    "time": (int, float),
    "config_hash": str,
    "files": dict,
    "xxh3_128": dict,
}


def read_manifest(path: Location) -> dict[str, Any]:
    """The manifest of checkpoint folder `path`, checked: UntrustedDataError (one line) if it is not one we wrote."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UntrustedDataError(f"{file} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(manifest, dict):
        raise UntrustedDataError(f"{file} is not a manifest (a JSON object)")
    if "xxh3_128" not in manifest:
        raise UntrustedDataError(f"{file} records no checksums: a launch before checksums wrote it")
    for key, kind in _MANIFEST_FIELDS.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise UntrustedDataError(f"{file} has a bad or missing {key!r}: {value!r}")
    sums = manifest["xxh3_128"]
    for name, size in manifest["files"].items():
        if not isinstance(name, str) or "/" in name or name.startswith("..") or not isinstance(size, int):
            raise UntrustedDataError(f"{file} lists a bad file entry {name!r}: {size!r}")
        if not isinstance(sums.get(name), str):
            raise UntrustedDataError(f"{file} records no checksum of {name!r}: written by an older launch")
    if not isinstance(manifest.get("stream"), (dict, type(None))):
        raise UntrustedDataError(f"{file} has a bad 'stream': {manifest['stream']!r}")
    run_id = manifest.get("run_id")  # absent or None: saved before manifests recorded it, or outside a launch
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID_PATTERN.fullmatch(run_id)):
        raise UntrustedDataError(f"{file} has a bad 'run_id': {run_id!r}")
    return manifest


def record(
    run: dict[str, Any], position: Position, time: float, files: dict[str, int], sums: dict[str, str]
) -> dict[str, Any]:
    """The manifest of a checkpoint at `position`: the run's fields (`manifest_of`), when it was made visible, and
    each file's size and xxh3-128 checksum. `read_manifest` checks what this writes."""
    stream = {"stream": position.stream} if position.stream is not None else {}
    return {
        **run,
        "step": position.step,
        "samples": position.samples,
        **stream,
        "time": time,
        "files": files,
        "xxh3_128": sums,
    }


def manifest_of(cfg: Any, world_size: int, precision: str) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run, beside its step and files."""
    from omegaconf import OmegaConf

    from launcher.config.identity import sweep_identity

    job = cfg.job
    return {
        "strategy": OmegaConf.select(cfg, "job.choices.strategy", default=None) or cfg.strategy._target_,
        "world_size": world_size,
        "precision": precision,
        "config_hash": job.config_hash,
        "overrides": sweep_identity(job.overrides) if job.get("sweep_dir") else None,
        "run_id": job.get("run_id"),  # the logger run it belongs to (`launcher.parent.run_id`)
    }


# ------------------------------------------------------------------ finding checkpoints


def is_complete(path: Location) -> bool:
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


def by_time(checkpoints: Location, say: Callable[[str], None] | None = None) -> list[Location]:
    """The checkpoints under `checkpoints/` whose manifests parse, newest first: by the time each manifest records,
    then by step; `say`, if given, is told one line for each folder whose manifest does not parse. Not by the
    `latest` pointer, which is moved last: a save killed between its rename and the pointer's move is the newest. Not
    by step alone: a run resumed from further back saves steps older than ones already there, and those it saves are
    the newer. The one meaning of "newest": resume, `resume=auto`, convert and pruning all use it. A save still
    being written in object storage (`is_partial`) is no checkpoint yet, and is not said."""
    found = []
    for path in sorted(checkpoints.glob("step_*")):
        if is_remote(path) and is_partial(path):
            continue
        try:
            found.append((float(read_manifest(path)["time"]), path.name, path))
        except UntrustedDataError as e:
            if say is not None:
                say(skipped(path, str(e)))
    return [path for *_, path in sorted(found, reverse=True)]


def complete(checkpoints: Location) -> list[Location]:
    """The complete checkpoints under `checkpoints/`, newest first (`by_time`)."""
    return [path for path in by_time(checkpoints) if is_complete(path)]


def latest(checkpoints: Location) -> Location | None:
    found = complete(checkpoints)
    return found[0] if found else None


def damage(path: Location) -> str | None:
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


def skipped(path: Location, why: str) -> str:
    """The line a fallback prints."""
    return f"launch: skipping checkpoint {path}: {why}"


def newest_intact(checkpoints: Location, say: Callable[[str], None] = print) -> Location | None:
    """The newest checkpoint under `checkpoints/` (`by_time`) that verifies (`damage`); `say` is told one line for
    each newer one skipped, and for each folder whose manifest does not parse."""
    for path in by_time(checkpoints, say):
        why = damage(path)
        if why is None:
            return path
        say(skipped(path, why))
    return None


def intact(path: Location) -> Location:
    """`path` if the checkpoint there verifies; else CheckpointError, the line that names the file and why."""
    why = damage(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {why}; resume from another one")
    return path


def rng_state() -> dict[str, Any]:
    """What `rng_<rank>.pt` holds: the generators training draws from (dropout); the data order is a pure function
    of seed and position."""
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def remove_partial(checkpoints: Location) -> None:
    """Folders of saves that never finished (a kill, a crash): no complete checkpoint is among them."""
    for stale in checkpoints.glob(".step_*.partial" if not is_remote(checkpoints) else "step_*"):
        if is_partial(stale):
            remove(stale)


def find_checkpoint(path: Location) -> Location:
    """A checkpoint folder that verifies, or the newest one that does of a run directory or checkpoints folder (a
    line for each newer one skipped)."""
    if (path / MANIFEST).exists():
        return intact(path)
    found = newest_intact(path / "checkpoints") if (path / "checkpoints").is_dir() else newest_intact(path)
    if found is None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no valid manifest.json and files); "
            "give a checkpoints/step_* folder or a run directory"
        )
    return found
