"""Loading checkpoints: into a strategy of any layout and world size (collective), and the checks the launcher makes
before any worker starts (which checkpoint `resume=` names, whether it fits the model). Everything is read as data
(`launcher.checkpoint.untrusted`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launcher.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    Position,
    by_time,
    intact,
    is_complete,
    newest_intact,
    read_manifest,
    rng_name,
    set_rng_state,
)
from launcher.checkpoint.untrusted import UntrustedDataError, dcp_load, read_metadata


def load(checkpoint: Path, manifest: dict[str, Any], strategy: Any, rank: int, world_size: int) -> Position:
    """Load model and optimizer state into the strategy (collective); restore RNG when the world size is unchanged.

    `manifest` is rank 0's reading of the checkpoint's manifest (`read_manifest`), the same on every rank."""
    import torch

    state = strategy.state_dict()  # the template: this strategy's layout, filled in place from any layout
    read_into(state, checkpoint)
    strategy.load_state_dict(state)
    rng = checkpoint / rng_name(rank)
    if manifest["world_size"] == world_size and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=True))
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
        for path in by_time(folder, say=print):  # the run's newest complete checkpoint
            if not is_complete(path):
                continue
            manifest = read_manifest(path)
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
