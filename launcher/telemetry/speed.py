"""The speed figures of logged steps: step time, throughput, MFU, and the planner's figures beside the measured
ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.plan.costs import GPT_TARGET, flops_per_token, peak_tflops, strategy_comm
from strategies import RunContext, Strategy


@dataclass(frozen=True)
class Speed:
    """What turns a logged step into MFU, and the planner's figures beside the measured ones: worked out once."""

    flops_per_token: float
    peak_flops: float | None
    """Per device; None (no MFU logged) on a device the table does not know, unless trainer.peak_tflops is set."""
    comm_bytes_formula: float
    """The planner's bytes each rank sends per optimizer step, from the strategy's declared collectives (`launch
    plan`'s figure)."""
    plan_peak_bytes: float | None = None
    """The planner's peak per rank for this run (computed by the launcher), beside the measured peak_memory_bytes."""

    @classmethod
    def of(cls, cfg: DictConfig, ctx: RunContext, strategy: Strategy) -> Speed:
        params = int(cfg.derived.model.params)  # counted on the meta device by the launcher, tied weights once
        model = cfg.model
        gpt = model._target_ == GPT_TARGET
        shape = (model.n_layer, model.n_embd, model.block_size) if gpt else ()  # user models: 6 x parameters only
        peak = cfg.trainer.peak_tflops
        if peak is None and ctx.device_type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(ctx.device))
        gpus = ctx.local_world_size
        gathered = int(cfg.derived.model.get("gathered", 0))  # optim=muon's whole matrices (`ModelSize.gathered`)
        split = int(cfg.derived.model.get("tensor_split", 0))  # what a tensor-parallel plan splits
        reused = int(cfg.derived.model.get("reused", 0))  # held by several modules (`ModelSize.reused`)
        formula = sum(
            strategy_comm(
                strategy, params, ctx.precision, ctx.accumulation, ctx.world_size, gpus, gathered, split, reused
            )
        )
        planned = OmegaConf.select(cfg, "derived.plan_peak_bytes", default=None)
        return cls(flops_per_token(params, *shape), peak * 1e12 if peak else None, formula, planned)

    def metrics(self, tokens_per_s: float | None, world_size: int) -> dict[str, float]:
        figures = {"comm_bytes_formula": self.comm_bytes_formula}
        if self.plan_peak_bytes is not None:
            figures["plan_peak_bytes"] = self.plan_peak_bytes
        if self.peak_flops and tokens_per_s is not None:
            # tokens_per_s is over all ranks; the peak is one device's.
            figures["mfu"] = self.flops_per_token * tokens_per_s / (world_size * self.peak_flops)
        return figures


@dataclass
class Window:
    """The steps since the last log: their times and tokens. Steps whose memory was measured are slowed by the
    measuring, so they are left out of the speed figures whenever the window has others."""

    steps: list[tuple[float, int, bool]] = field(default_factory=list)
    """(seconds, this rank's tokens, measured) per step."""

    def add(self, seconds: float, tokens: int, measured: bool) -> None:
        self.steps.append((seconds, tokens, measured))

    def kept(self) -> list[tuple[float, int, bool]]:
        return [s for s in self.steps if not s[2]] or self.steps

    def tokens(self) -> float:
        """This rank's tokens in the kept steps (summed over ranks with the step's figures, `figures` reads it)."""
        return float(sum(s[1] for s in self.kept()))

    def figures(self, global_size: int, tokens: float) -> dict[str, float]:
        """Speed over the kept steps; `tokens`: theirs, summed over ranks."""
        kept = self.kept()
        seconds = sum(s[0] for s in kept)
        figures = {"step_time_s": seconds / len(kept), "samples_per_s": global_size * len(kept) / seconds}
        if tokens:  # only batches of integer token ids have tokens to count (not images, not features)
            figures["tokens_per_s"] = tokens / seconds
        return figures
