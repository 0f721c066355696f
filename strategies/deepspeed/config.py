"""The DeepSpeed config of a run, generated from the run's plain values; no `import deepspeed` here.

`build_ds_config` derives every key the launcher owns (batch sizes, accumulation, precision, clipping, the ZeRO
stage and offload); `strategy.ds_config` adds keys the launcher does not derive. A user key that contradicts a
derived one is an error naming both values: a silently overridden accumulation setting is the most reported pain
with other launchers.
"""

from __future__ import annotations

from typing import Any

from strategies.base import RunContext

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Keys the launcher derives, and the setting they come from. A `ds_config` entry at one of these
# paths with a different value is an error. Keys in OWNED may not appear in `ds_config` at all.
DERIVED_FROM = {
    "train_batch_size": "batch.global_size",
    "train_micro_batch_size_per_gpu": "batch.micro_size",
    "gradient_accumulation_steps": "batch.global_size / (batch.micro_size x world size)",
    "gradient_clipping": "trainer.grad_clip",
    "bf16.enabled": "precision",
    "bf16.check_grad_overflow": "the rule that a NaN or Inf step is never applied",
    "fp16.enabled": "precision",
    "optimizer": "optim",
    "scheduler": "trainer.schedule",
    "zero_optimization.stage": "strategy.stage",
    "zero_optimization.offload_optimizer.device": "strategy.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "strategy.nvme_path",
    "zero_optimization.offload_param.device": "strategy.offload_params",
    "zero_optimization.offload_param.nvme_path": "strategy.nvme_path",
}
OWNED = (
    "optimizer",
    "scheduler",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path",
)
_MISSING = object()


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's own default for its reduce and all-gather buckets (5e8 elements: 2 GB in fp32, whatever the model)."""
BUCKET_SHARE = 8
"""Buckets of at most 1/8 of the model's parameters: a small model's buckets are no larger than its state."""
BUCKET_ALIGNMENT = 2
"""ZeRO-1/2 assert that the all-gather bucket is a multiple of their `nccl_start_alignment_factor` (deepspeed 0.19:
2 elements, a 4-byte boundary in 16-bit, on every accelerator and in every dtype; `DeepSpeedZeroOptimizer.__init__`).
Both gradient buckets are sized in its multiples."""


def buffers(stage: int, params: int) -> dict[str, Any]:
    """DeepSpeed's buffer sizes for a model of `params` parameters: its defaults (5e8 elements for the gradient
    buckets, 1e9 for ZeRO-3's live parameters and optimizer sub-groups) hold gigabytes beyond the sharding rule
    for any model under a few billion parameters. Each is capped at 1/BUCKET_SHARE of the model, rounded down to
    DeepSpeed's alignment (at least one multiple of it); a key in strategy.ds_config overrides it."""
    share = min(BUCKET_ELEMENTS, params // BUCKET_SHARE)
    bucket = max(BUCKET_ALIGNMENT, share - share % BUCKET_ALIGNMENT)
    sized: dict[str, Any] = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        sized |= {
            "stage3_prefetch_bucket_size": bucket,
            "stage3_max_live_parameters": bucket,
            "stage3_max_reuse_distance": bucket,
            "sub_group_size": max(bucket, 1),
        }
    return sized


def build_ds_config(
    ctx: RunContext,
    stage: int,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    swap_path: str | None = None,
    extra: dict[str, Any] | None = None,
    params: int | None = None,
    largest: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a run: derived from the run's values, plus the user's extra keys.

    `params` and `largest` (the model's parameter count and its largest parameter's, once it is built) size
    DeepSpeed's buffers to the model (`buffers`; for NVMe parameter offload, its swap buffers).
    Raises ValueError (one line) when an extra key contradicts a derived value.
    """
    pin = ctx.device_type == "cuda"  # pinned host buffers speed up device copies; there is no device on CPU

    def offload(device: str) -> dict[str, Any]:
        section: dict[str, Any] = {"device": device, "pin_memory": pin}
        if device == "nvme":
            section["nvme_path"] = swap_path
        return section

    zero: dict[str, Any] = {"stage": stage, **(buffers(stage, params) if params else {})}
    if stage < 3:
        # ZeRO-1/2 reduce each gradient bucket to the rank that owns its partition, a reduce-scatter's volume; by
        # default DeepSpeed all-reduces the buckets and each rank keeps its slice: twice the bytes, for nothing.
        zero["use_multi_rank_bucket_allreduce"] = False
    if stage == 3:
        # Parameters under DeepSpeed's persistence threshold stay gathered on every rank; its default
        # (1e5 elements) keeps all of a small model whole. 0 keeps the layout's rule: every parameter
        # sharded. Raise it in strategy.ds_config to trade memory for fewer small all-gathers.
        zero["stage3_param_persistence_threshold"] = 0
    if offload_optimizer != "none":
        zero["offload_optimizer"] = offload(offload_optimizer)
    if offload_params != "none":
        zero["offload_param"] = offload(offload_params)
        if offload_params == "nvme" and params and largest:
            # Its swap buffers default to 5 x 1e8 elements (2 GB in fp32) whatever the model; each must hold the
            # largest parameter (with its I/O alignment), and together they need hold no more than a bucket.
            size = -(-max(largest, params // BUCKET_SHARE) // 4096) * 4096 + 4096
            zero["offload_param"] |= {"buffer_size": size}
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ctx.micro_size,
        "gradient_accumulation_steps": ctx.accumulation,
        "train_batch_size": ctx.micro_size * ctx.accumulation * ctx.world_size,
        # Always written: DeepSpeed clips at 1.0 when the key is absent; 0 disables.
        "gradient_clipping": ctx.grad_clip,
        # DeepSpeed's own default, written so that it holds: under bf16 a NaN or Inf gradient norm is an overflow,
        # and the step is discarded (in fp32 and fp16 it always is).
        "bf16": {"enabled": ctx.precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": ctx.precision == "fp16"},
        "zero_optimization": zero,
        # The client optimizer comes from optim (SGD included): DeepSpeed only tests its own.
        "zero_allow_untested_optimizer": True,
    }
    extra = extra or {}
    for path, source in DERIVED_FROM.items():
        given, ours = _get(extra, path), _get(derived, path)
        if given is _MISSING:
            continue
        if path in OWNED:  # the client optimizer, our LR schedule, each rank's own swap folder
            raise ValueError(
                f"strategy.ds_config.{path}={given!r} conflicts with the launcher, which sets it "
                f"from {source}; remove it from strategy.ds_config"
            )
        if given != ours:
            raise ValueError(
                f"strategy.ds_config.{path}={given!r} conflicts with {path}={ours!r}, which the launcher "
                f"derives from {source}; remove it from strategy.ds_config"
            )
    return _merge(derived, extra)


def check_recipe(ctx: RunContext, stage: int, offload_params: str, ds_config: dict[str, Any], optimizer: str) -> None:
    """Raise ValueError (one line) for the optimizer recipe's parts ZeRO cannot run: Muon (no rank holds a whole
    matrix), EMA weights where the partitions are not in memory or some parameters are kept whole."""
    if optimizer.endswith(".MuonAdamW"):
        raise ValueError(
            "optim=muon under ZeRO: DeepSpeed flattens and partitions parameters across ranks, so no rank holds a "
            "whole matrix for Muon's orthogonalised update; use strategy=ddp, fsdp or hsdp with optim=muon"
        )
    if ctx.ema is not None and offload_params == "nvme":
        raise ValueError(
            "trainer.ema under strategy.offload_params=nvme: the EMA averages each rank's partition in host "
            "memory, which NVMe-offloaded parameters are not in; use strategy.offload_params=cpu or unset "
            "trainer.ema.decay"
        )
    if (
        ctx.ema is not None
        and stage == 3
        and ds_config.get("zero_optimization", {}).get("stage3_param_persistence_threshold", 0)
    ):
        raise ValueError(
            "trainer.ema under ZeRO-3 with a stage3_param_persistence_threshold: parameters kept whole are not "
            "averaged as their partitions; remove it from strategy.ds_config or unset trainer.ema.decay"
        )
