"""What a run is: the identity by which resume=auto finds an earlier run of it, a run directory knows its owner,
and a sweep tells its jobs apart. Every key counts but those the schema marks `launch_only`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config.ranges import untracked
from launcher.config.schema import TrainerConfig

# What the launcher adds to a frozen config: never part of what a run is.
ADDED = ("derived", "job")


def identity_hash(frozen: DictConfig, cfg: DictConfig) -> str:
    """Hash of what defines the run, for resume=auto and for who owns a run directory: every key of the frozen
    config except those its schema marks as how the run is launched, watched or kept (`launch_only` in
    `launcher.config.schema`, read from the composed `cfg`: strategy, world size, device, rendezvous, logger, planner,
    length, logging, checkpoints). Equal for a resumed or restarted run, different for a sweep's other jobs; a key
    added to the schema counts unless it is marked."""
    plain: dict[str, Any] = OmegaConf.to_container(frozen)  # type: ignore[assignment]
    for key in ADDED:
        plain.pop(key, None)
    from launcher.data.builtin import SKIP_CHECK

    if isinstance(plain.get("data"), dict):
        plain["data"].pop(SKIP_CHECK, None)  # +data._check_=false: whether the launcher builds the data first
        if plain["data"].get("collate") == {"_target_": None}:  # the default collate: runs from before it had a key
            plain["data"].pop("collate")
    for dotted in untracked(cfg):
        *parents, leaf = dotted.split(".")
        node: Any = plain
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _trainer_counts(leaf: str) -> bool:
    """Whether trainer.<leaf> is part of a run's identity, by its mark in the schema."""
    spec = next((f for f in dataclasses.fields(TrainerConfig) if f.name == leaf), None)
    return spec is None or spec.metadata.get("identity", True)


def sweep_identity(overrides: Any) -> list[str]:
    """A sweep job's identity among the jobs of its sweep: its overrides, sorted, without those that one changes to
    continue a run (resume, how long and how verbosely it runs, logger, rendezvous, planner). Two jobs of a sweep
    may share an identity hash (a sweep over strategies); their overrides still tell them apart."""
    kept = []
    for override in overrides or ():
        key = str(override).lstrip("+~").split("=", 1)[0]
        group, _, leaf = key.partition(".")
        continues = key == "resume" or group in ("logger", "rdzv", "plan", "hydra")
        continues = continues or (group == "trainer" and not _trainer_counts(leaf))
        if not continues:
            kept.append(str(override))
    return sorted(kept)
