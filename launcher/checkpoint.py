"""Checkpoints: one strategy-neutral format, written collectively and atomically.

Layout of `<run dir>/checkpoints/`:
    step_00000006/        .metadata + one .distcp per rank (torch.distributed.checkpoint),
                          manifest.json (written last), rng_<rank>.pt
    latest                the name of the newest complete checkpoint (updated after the rename)

Model and optimizer state are whatever `strategy.state_dict()` returns: torch's state-dict
shape keyed by parameter names (plain tensors for replicated strategies, DTensor shards for
FSDP, full tensors exported by DeepSpeed). DCP stores each tensor once and re-slices it on load,
so any checkpoint loads under any strategy and world size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def config_hash(resolved: dict[str, Any]) -> str:
    """Hash of what defines the run (everything but how it was launched and where it resumes from)."""
    core = {k: v for k, v in resolved.items() if k not in ("derived", "job", "resume", "rdzv", "trainer", "logger")}
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / ".metadata").is_file()


def latest(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint under `checkpoints/`: the `latest` pointer, else a scan."""
    pointer = checkpoints / LATEST
    if pointer.is_file():
        candidate = checkpoints / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    done = sorted(p for p in checkpoints.glob("step_*") if is_complete(p))
    return done[-1] if done else None


def find_resume(resume: str | None, run_dir: Path) -> Path | None:
    """Resolve `resume=` (None, auto, a run directory or a checkpoint directory) to a checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        roots = [run_dir.parent, run_dir.parent.parent]
        found = [
            c
            for root in roots
            for pattern in ("*/checkpoints", "*/*/checkpoints")
            for d in root.glob(pattern)
            if (c := latest(d)) is not None and d.parent != run_dir
        ]
        return max(found, key=lambda c: json.loads((c / MANIFEST).read_text())["time"], default=None)
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    found = latest(path / "checkpoints") if path.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"resume={resume}: no complete checkpoint there; give a run directory or a checkpoints/step_* folder"
        )
    return found


def check_fits(checkpoint: Path, model: Any) -> None:
    """Compare the checkpoint's model tensors with a model built on the meta device; CheckpointError names a
    mismatch."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise CheckpointError(
            f"checkpoint {checkpoint} is unreadable ({type(e).__name__}: {e}); resume from another one"
        ) from e
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
                f"{list(shape)} here; "
                "resume with the model settings it was saved with"
            )


def save(
    checkpoints: Path, position: Position, strategy: Any, manifest: dict[str, Any], rank: int, keep_last: int
) -> Path:
    """Save on every rank (collective), atomically: temp folder, barrier, rename, then the `latest` pointer."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    name = f"step_{position.step:08d}"
    final, tmp = checkpoints / name, checkpoints / f".{name}.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(strategy.state_dict(), checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_{rank}.pt")
    dist.barrier()  # every shard and RNG file is on disk before the checkpoint becomes visible
    if rank == 0:
        record = {**manifest, "step": position.step, "samples": position.samples, "time": time.time()}
        (tmp / MANIFEST).write_text(json.dumps(record, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = checkpoints / f".{LATEST}.tmp"
        pointer.write_text(name)
        os.replace(pointer, checkpoints / LATEST)
        _prune(checkpoints, keep_last)
    dist.barrier()
    return final


def load(checkpoint: Path, strategy: Any, rank: int, world_size: int) -> Position:
    """Load model and optimizer state into the strategy (collective); restore RNG when the world size is unchanged."""
    import torch

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    state = strategy.state_dict()  # the template: this strategy's layout, filled in place from any layout
    read_into(state, checkpoint)
    strategy.load_state_dict(state)
    rng = checkpoint / f"rng_{rank}.pt"
    if manifest.get("world_size") == world_size and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    return Position(step=int(manifest["step"]), samples=int(manifest["samples"]))


def _weights_only() -> Any:
    """A DCP load planner that reads non-tensor entries (hyperparameters) with `weights_only=True`.

    DCP's default planner unpickles them with `weights_only=False`, which runs whatever code a
    crafted file holds; this one loads tensors and plain values only.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnly(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnly()


def _check_plain(checkpoint: Path, entries: dict[str, Any]) -> None:
    """Read every non-tensor entry as the workers will (in this process, no process group); CheckpointError if
    one is not plain data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    plain = {k: None for k, v in entries.items() if isinstance(v, BytesStorageMetadata)}  # flat keys: DCP's own names
    try:
        dcp.load(plain, checkpoint_id=str(checkpoint), planner=_weights_only(), no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:  # DCP's exception is a BaseException
        reason = next((line for line in str(e).splitlines() if "GLOBAL" in line), type(e).__name__).strip()
        raise CheckpointError(
            f"checkpoint {checkpoint} holds an entry that is not plain data ({reason}); "
            "resume only from checkpoints launch wrote"
        ) from e


def read_into(state: dict[str, Any], checkpoint: Path) -> None:
    """Fill `state` (a strategy's state dict: model, optim) in place from a checkpoint of any layout (collective)."""
    import torch.distributed.checkpoint as dcp

    stored = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    # Optimizers name their hyperparameters differently (torch's AdamW has `maximize`, DeepSpeed's
    # CPU Adam `bias_correction`): those the checkpoint lacks keep this run's values.
    groups = state.get("optim", {}).get("param_groups", [])
    own = [
        {k: g.pop(k) for k in list(g) if k != "params" and f"optim.param_groups.{i}.{k}" not in stored}
        for i, g in enumerate(groups)
    ]
    dcp.load(state, checkpoint_id=str(checkpoint), planner=_weights_only())
    for group, values in zip(groups, own, strict=True):
        group.update(values)


def _rng_state() -> dict[str, Any]:
    """The generators training draws from (dropout); the data order is a pure function of seed and position."""
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _prune(checkpoints: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in checkpoints.glob("step_*") if is_complete(p))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def convert(checkpoint: Path, out: Path) -> int:
    """Write the model weights of any checkpoint as one safetensors file, loadable into the plain model."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not is_complete(checkpoint):
        found = latest(checkpoint / "checkpoints") if (checkpoint / "checkpoints").is_dir() else latest(checkpoint)
        if found is None:
            raise CheckpointError(
                f"{checkpoint} is not a complete checkpoint (no .metadata and manifest.json); "
                "give a checkpoints/step_* folder"
            )
        checkpoint = found
    keys = {k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata if k.startswith("model.")}
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the point here
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys, checkpoint_id=str(checkpoint))["model"]
    tensors = {name: t.contiguous() for name, t in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"checkpoint": str(checkpoint)})
    os.replace(tmp, out)
    return sum(t.numel() for t in tensors.values())
