"""A rank's view of a frozen config: its `RunContext` and its strategy object.

Workers build them for themselves; the launcher builds rank 0's for the strategy's checks before any worker
starts, and the planner builds strategies to read their layouts. One function each, so all three see the same.
"""

from __future__ import annotations

from omegaconf import DictConfig

from strategies import RunContext, Strategy


def run_context(cfg: DictConfig, rank: int, local_rank: int, world_size: int) -> RunContext:
    """What a strategy may know of the run, for one rank of a frozen config that carries `derived`."""
    derived = cfg.derived
    return RunContext(
        device=f"cuda:{local_rank}" if derived.device == "cuda" else "cpu",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        precision=str(cfg.precision),
        grad_clip=float(cfg.trainer.grad_clip),
        accumulation=int(derived.accumulation),
        micro_size=int(cfg.batch.micro_size),
        compile=bool(cfg.trainer.compile),
        local_world_size=int(derived.gpus),
    )


def make_strategy(strategy: DictConfig) -> Strategy:
    """The strategy a config node names, built from plain values (dicts and lists, no OmegaConf nodes)."""
    from hydra.utils import instantiate

    return instantiate(strategy, _convert_="all")
