"""The worker's training data: the train split as a source of global batches (`launcher.data.sources`: random access
or a stream), this rank's micro-batches of each step from the resumed position on, and the ranks' agreement that a
stream ran out, so that every rank ends at the same step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launcher.base.collectives import all_reduce
from launcher.checkpoint.format import Position
from launcher.data.builtin import BUILT_IN_DATA, build_dataset, check_token_ids
from launcher.data.collate import build_collate
from launcher.data.sources import Reading, StepData, source_of
from strategies import RunContext


def training_source(cfg: DictConfig) -> Any:
    """The train split, read in the batch contract's order: step s's global batch depends on the seed and the global
    batch alone."""
    collate = build_collate(cfg.data.get("collate"))
    return source_of(build_dataset(cfg.data, "train"), int(cfg.batch.global_size), cfg.seed, collate, "the train split")


def feed(
    cfg: DictConfig, ctx: RunContext, source: Any, position: Position, max_steps: int, K: int, device: torch.device
) -> Iterator[StepData]:
    """This rank's micro-batches from the resumed position on, K per step; token ids checked against the
    vocabulary as they are read, unless the launcher checked the built-in data's before start."""
    first = position.step + 1
    vocab = OmegaConf.select(cfg, "derived.vocab_size", default=None)
    check = None
    if vocab is not None and not str(cfg.data._target_).startswith(BUILT_IN_DATA):

        def check(batch: Any, n: int) -> None:
            check_token_ids(batch, vocab, first + n // K)

    steps = max_steps - position.step
    workers = int(cfg.data.get("workers", 0))
    return source.feed(position, steps, Reading(ctx.data_rank, ctx.data_world, K, workers, device, check))


def next_step(steps: Iterator[StepData], source: Any, device: torch.device) -> StepData | None:
    """This rank's micro-batches of the next step; None when the stream ran out on any rank, which every rank learns
    in one all-reduce before any forward (a source that never ends needs none)."""
    got = next(steps, None)
    if source.ends and all_reduce([float(got is None)], dist.ReduceOp.MAX, device)[0]:
        return None
    return got
