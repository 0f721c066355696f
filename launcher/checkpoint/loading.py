"""Loading checkpoints: into a strategy of any layout and world size (collective), and the checks the launcher makes
before any worker starts (which checkpoint `resume=` names, whether it fits the model). Everything is read as data
(`launcher.checkpoint.untrusted`)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from launcher.base.storage import Location, check_url, is_remote, location, masked
from launcher.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    Position,
    by_time,
    intact,
    is_complete,
    latest,
    newest_intact,
    read_manifest,
    rng_name,
    set_rng_state,
)
from launcher.checkpoint.untrusted import UntrustedDataError, dcp_load, read_metadata


def load(checkpoint: Location, manifest: dict[str, Any], strategy: Any, rank: int, world_size: int) -> Position:
    """Load model and optimizer state into the strategy (collective); restore RNG when the world size is unchanged.

    `manifest` is rank 0's reading of the checkpoint's manifest (`read_manifest`), the same on every rank."""
    import torch

    state = strategy.state_dict()  # the template: this strategy's layout, filled in place from any layout
    read_into(state, checkpoint)
    strategy.load_state_dict(state)
    rng = checkpoint / rng_name(rank)
    if manifest["world_size"] == world_size and rng.is_file():
        set_rng_state(torch.load(io.BytesIO(rng.read_bytes()), weights_only=True))
    return Position(step=manifest["step"], samples=manifest["samples"], stream=manifest.get("stream"))


def read_into(state: dict[str, Any], checkpoint: Location) -> None:
    """Fill `state` (a strategy's state dict: model, optim) in place from a checkpoint of any layout (collective)."""
    stored = set(read_metadata(checkpoint).state_dict_metadata)
    if "ema" in state and not any(key.startswith("ema.") for key in stored):
        del state["ema"]  # saved without trainer.ema: the average starts from the loaded weights (the strategy's load)
    # Optimizers name their hyperparameters differently (torch's AdamW has `maximize`, DeepSpeed's
    # CPU Adam `bias_correction`): those the checkpoint lacks keep this run's values.
    groups = state.get("optim", {}).get("param_groups", [])
    own = [
        {k: g.pop(k) for k in list(g) if k != "params" and f"optim.param_groups.{i}.{k}" not in stored}
        for i, g in enumerate(groups)
    ]
    # A parameter that never got a gradient where the checkpoint was saved has no optimizer state there (torch's
    # optimizers make none for a `.grad` that is None): it gets none here either, as it had none then. A checkpoint
    # with no optimizer state at all (another optimizer's) still fails on the first entry it lacks.
    saved = {key.removeprefix("optim.state.").rpartition(".")[0] for key in stored if key.startswith("optim.state.")}
    states = state.get("optim", {}).get("state", {})
    for name in [n for n in states if n not in saved] if saved else []:
        del states[name]
    dcp_load(state, checkpoint)
    for group, values in zip(groups, own, strict=True):
        group.update(values)


def find_resume(
    resume: str | None, run_dir: Path, identity: dict[str, Any], checkpoints: Location | None = None
) -> Location | None:
    """Resolve `resume=` (None, auto, a run directory, a checkpoints folder or a checkpoint, local or at a URL) to a
    checkpoint.

    `auto` takes the newest checkpoint of an earlier run of the same identity (`identity["config_hash"]`; in a
    sweep also the same overrides, and never a sibling job of this sweep), owned by this user; with
    trainer.checkpoint_dir set (`checkpoints`), the newest there (`check_folder` made sure they are this run's).
    """
    if resume is None:
        return None
    if resume == "auto":
        return _auto(run_dir, identity) if checkpoints is None else newest_intact(checkpoints)
    path = location(resume)
    if is_remote(path) and (why := check_url(path.url)):  # type: ignore[union-attr]
        raise CheckpointError(f"resume={path}: {why}")
    if (path / MANIFEST).exists():  # a checkpoint folder: this one or none
        return intact(path)
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = newest_intact(folder) if folder.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"resume={masked(resume)}: no complete checkpoint there; give a run directory, a checkpoints folder or a "
            "checkpoints/step_* folder (local, or its URL)"
        )
    return found


def check_folder(checkpoints: Location, identity: dict[str, Any]) -> None:
    """trainer.checkpoint_dir, checked before anything is written: a URL that can hold checkpoints
    (`storage.check_url`), and no other run's checkpoints there (locally the run directory's claim guards them)."""
    if is_remote(checkpoints) and (why := check_url(str(checkpoints))):
        raise CheckpointError(f"trainer.checkpoint_dir={checkpoints}: {why}")
    found = latest(checkpoints)
    if found is None:
        return
    manifest = read_manifest(found)
    if manifest["config_hash"] != identity["config_hash"] or manifest.get("overrides") != identity.get("overrides"):
        raise CheckpointError(
            f"trainer.checkpoint_dir={checkpoints} holds checkpoints of another run ({found}, config hash "
            f"{manifest['config_hash']}); choose another trainer.checkpoint_dir, and resume={found} to start from them"
        )


def _auto(run_dir: Path, identity: dict[str, Any]) -> Location | None:
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


def check_fits(checkpoint: Location, model: Any) -> None:
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
            parent = name.rsplit(".", 2)[0] + "."  # the tensors of the module around it, as the checkpoint names them
            there = sorted(k for k in stored if k.startswith(parent) and k not in expected)[:3]
            held = f" (it holds {', '.join(there)} there)" if there else ""
            raise CheckpointError(
                f"checkpoint {checkpoint} has no tensor {name} of the model{held}; resume with the model it was "
                "saved from"
            )
        if stored[name] != shape:
            raise CheckpointError(
                f"checkpoint {checkpoint} does not fit the model: {name} is {list(stored[name])} there, "
                f"{list(shape)} here; resume with the model settings it was saved with"
            )


def _check_plain(checkpoint: Location, entries: dict[str, Any]) -> None:
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
