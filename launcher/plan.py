"""`launch plan` and `strategy=auto`: per-rank memory and communication of a run, before it starts.

It answers what a user asks before a run — will it fit, how long will the gradient sync take,
what is my effective batch — from the same composed config the run would use. In three layers:

1. Pure arithmetic over plain numbers: bytes per parameter, per-rank bytes, ring collectives,
   activations. Small typed functions; the tests call them with the seed lesson's numbers.
2. `make_plan`: that arithmetic applied to a composed config. Each strategy's `layout()` says what
   it shards and offloads (the planner keeps no table of strategy rules); `derive()` gives the batch.
3. Output (table, json, chart) and the two entry points: `main` (`launch plan`) and `choose`
   (`strategy=auto`, called by launch.prepare before anything else).

Units: parameters and elements are counts; memory is in bytes, printed in GB (1e9 bytes, as in the
lesson's figures; MB or kB for a tiny model); links are in GB/s per GPU (gigaBYTES per second); times are in seconds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError, Derived, _positive, derive
from strategies.base import Layout, Placement

GB = 1e9
MIXED_PRECISIONS = ("bf16", "fp16")
KINDS = ("weights", "master", "grads", "moments")
"""Kinds of model state, in the order they are printed and stacked."""
PLACES = ("device", "cpu", "nvme")
"""Where a kind can live (Placement.where); "cpu" is host memory."""
DEFAULT_DEVICE_MEMORY_GB = 80.0
"""Assumed per-device memory when no GPU is visible and plan.device_memory_gb is unset (A100/H100 80 GB)."""
AUTO = "auto"
AUTO_TARGET = "launcher.plan.Auto"
GPT_TARGET = "launcher.models.gpt.GPT"
"""The built-in GPT: the model the activation formula describes."""
MAX_NODES = 4096
"""How far `what would fit` looks for more nodes."""


# ============================================================================================
# 1. Arithmetic
# ============================================================================================


@dataclass(frozen=True)
class BytesPerParam:
    """What one parameter costs, by kind of model state."""

    weights: int
    """The parameters the forward reads: 2 in bf16/fp16, 4 in fp32."""
    master: int
    """The fp32 copy the optimizer updates: 4 under mixed precision or when the strategy keeps its own, else 0."""
    grads: int
    """fp32 gradients: 4."""
    moments: int
    """Optimizer state: 4 per fp32 moment."""

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.moments


def bytes_per_param(precision: str, moments: int, master_weights: bool = False) -> BytesPerParam:
    """The mixed-precision rule (bf16/fp16): 16-bit weights, fp32 master weights, fp32 gradients and fp32
    moments — with Adam 2 + 4 + 4 + 2 x 4 = 18 bytes (the lesson's exercise 1). In fp32 the weights are the
    master copy, unless the strategy's optimizer keeps its own (`Layout.master_weights`: DeepSpeed)."""
    mixed = precision in MIXED_PRECISIONS
    return BytesPerParam(
        weights=2 if mixed else 4,
        master=4 if mixed or master_weights else 0,
        grads=4,
        moments=4 * moments,
    )


def optimizer_moments(target: str, momentum: float = 0.0) -> int:
    """fp32 tensors the optimizer keeps per parameter: Adam/AdamW 2 (first and second moment), SGD 1 with
    momentum and 0 without. Raises ConfigError for an optimizer whose state the planner cannot size."""
    name = target.rsplit(".", 1)[-1]
    if name in ("Adam", "AdamW"):
        return 2
    if name == "SGD":
        return 1 if momentum else 0
    raise ConfigError(f"optim._target_={target}: the planner knows the state of Adam, AdamW and SGD only; "
                      "plan with optim=adamw or optim=sgd")


def per_rank_bytes(params: int, bpp: BytesPerParam, layout: Layout, world_size: int) -> dict[str, dict[str, float]]:
    """Bytes of each kind of model state one rank holds, by place: {place: {kind: bytes}}.

    A sharded kind costs 1/G of the model on each rank, a replicated one all of it. The master weights
    live with the optimizer state: both are what the optimizer steps on.
    """
    placements = {"weights": layout.params, "master": layout.optimizer, "grads": layout.grads, "moments": layout.optimizer}
    held = {place: dict.fromkeys(KINDS, 0.0) for place in PLACES}
    for kind, placement in placements.items():
        held[placement.where][kind] = params * getattr(bpp, kind) / (world_size if placement.sharded else 1)
    return held


def gathered_bytes(largest_layer: int, weight_bytes: int, params_sharded: bool) -> float:
    """Device memory for the layer being computed when parameters are sharded: its gathered weights and,
    in backward, its full gradient before the reduce-scatter. DeepSpeed's `largest_layer_memory`
    (4 bytes per parameter of the largest layer in 16-bit). Replicated parameters need no such buffer."""
    return 2 * weight_bytes * largest_layer if params_sharded else 0.0


RING_PASSES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
"""Ring passes per collective: an all-reduce is a reduce-scatter then an all-gather."""


def ring_sent_elements(elements: float, world_size: int, collective: str = "all_reduce") -> float:
    """Elements each rank sends in a ring collective over a buffer of `elements`: (G-1)/G of it per pass."""
    return RING_PASSES[collective] * (world_size - 1) / world_size * elements


def ring_allreduce_elements(params: float, world_size: int) -> float:
    """Elements each rank sends in a ring all-reduce: a reduce-scatter then an all-gather, (G-1)/G of the buffer each."""
    return ring_sent_elements(params, world_size, "all_reduce")


def step_comm_elements(params: float, world_size: int, params_sharded: bool, accumulation: int = 1) -> float:
    """Elements each rank sends per optimizer step (gradients are synchronised once per step).

    Replicated parameters (DDP, ZeRO-1/2): one gradient all-reduce, 2(G-1)/G x P. (ZeRO-1/2 reduce-scatter
    the gradients and all-gather the updated parameters: the same volume.)
    Sharded parameters (FSDP, ZeRO-3): one gradient reduce-scatter, plus a parameter all-gather before each
    micro-step's forward and again before its backward: (1 + 2K)(G-1)/G x P — 1.5 x DDP's volume at K = 1.
    """
    one_pass = ring_sent_elements(params, world_size, "reduce_scatter")
    return one_pass * (1 + 2 * accumulation) if params_sharded else ring_allreduce_elements(params, world_size)


def step_comm_bytes(params: float, world_size: int, layout: Layout, precision: str, accumulation: int = 1) -> float:
    """Bytes each rank sends per optimizer step: `step_comm_elements` in the compute dtype (the lesson's exercise 2:
    bf16, 2 bytes). Strategies that reduce fp32 gradients under bf16 (DDP under autocast, FSDP's default
    reduce_dtype) send twice this; in fp32 the figure is exact."""
    weights = bytes_per_param(precision, 0, layout.master_weights).weights
    return step_comm_elements(params, world_size, layout.params.sharded, accumulation) * weights


def flops_per_token(params: int, n_layer: int = 0, n_embd: int = 0, seq_len: int = 0) -> float:
    """Model FLOPs to train on one token, forward and backward: 6 per parameter (2 in the forward matmul, 4 in
    backward's two) plus attention's scores and weighted values, 12 x layers x width x sequence (PaLM, appendix B;
    nanoGPT's estimate_mfu). A model without the GPT's sizes gets 6 x parameters only."""
    return 6 * params + 12 * n_layer * n_embd * seq_len


# Dense bf16/fp16 tensor-core peak per GPU, TFLOPS, from NVIDIA's datasheets (the "with sparsity" figures halved):
# H100/H200 SXM 989, H100 PCIe 756, A100 312, L40S 362, L4 121, A10 125, V100 125 (fp16). Matched in order, by
# substring of torch.cuda.get_device_name(): the PCIe H100 before the SXM one. MFU is measured against this
# figure whatever the run's precision (nanoGPT's convention); set trainer.peak_tflops for any other device.
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
               ("L4", 121.0), ("A10", 125.0), ("V100", 125.0))


def peak_tflops(device_name: str) -> float | None:
    """The table's peak for a GPU name (e.g. "NVIDIA H100 80GB HBM3"), or None for a device it does not know."""
    return next((tflops for key, tflops in PEAK_TFLOPS if key in device_name), None)


def bound_gbps(link_gbps: float, internode_gbps: float, nodes: int) -> float:
    """A ring over several nodes moves at the pace of its slowest hop: the inter-node link."""
    return link_gbps if nodes == 1 else min(link_gbps, internode_gbps)


def comm_seconds(nbytes: float, gbps: float) -> float:
    """Time to send `nbytes` at `gbps` GB/s (bandwidth only: no latency term, no overlap with compute)."""
    return nbytes / (gbps * GB)


def activation_bytes(seq: int, micro: int, hidden: int, heads: int, layers: int, vocab: int, elem: int,
                     checkpointing: bool = False) -> float:
    """Activations one rank keeps for backward, for one micro-batch of the built-in GPT.

    Per transformer layer, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", no tensor parallelism): s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations —
    34·s·b·h for what the matmuls, layer norms, GELU and dropout masks save, 5·a·s²·b for the attention
    scores, softmax and its dropout. We scale it by elem/2 for fp32. Both are upper bounds: the 1-byte dropout
    masks (2·s·b·h + a·s²·b) do not exist at dropout 0, the presets' default, and fused attention (SDPA's
    flash kernel on GPU) keeps no s x s matrices at all.
    Outside the layers: the embedding output and the final layer norm's input (s·b·h each), the logits
    (s·b·V at elem) and the fp32 log-probabilities cross-entropy saves (s·b·V·4).
    With activation checkpointing only each block's input is kept (s·b·h per layer), and one block's
    activations live again while it is recomputed in backward.
    """
    s, b, h, a, L, V = seq, micro, hidden, heads, layers, vocab
    per_layer = s * b * h * (34 + 5 * a * s / h) * elem / 2
    outside = 2 * s * b * h * elem + s * b * V * (elem + 4)
    if checkpointing:
        return L * s * b * h * elem + per_layer + outside
    return L * per_layer + outside


# ============================================================================================
# 2. The plan of a composed config
# ============================================================================================


class Auto:
    """The `strategy=auto` marker (conf/strategy/auto.yaml). Not a strategy: nothing can run it.
    launch.prepare() replaces it with the planner's choice (`choose`) before anything else reads the config."""

    def __init__(self, candidates: Sequence[str] = ()) -> None:
        self.candidates = [str(name) for name in candidates]


def is_auto(cfg: DictConfig) -> bool:
    return OmegaConf.select(cfg, "strategy._target_") == AUTO_TARGET


@dataclass(frozen=True)
class ModelSize:
    params: int
    """Parameters, each counted once (the GPT's tied embedding and head are one)."""
    largest_layer: int
    """Parameters of the largest single module, its own only: DeepSpeed's definition of the largest layer."""


@dataclass(frozen=True)
class DeviceMemory:
    total: float
    """Bytes per device."""
    headroom: float
    source: str
    """Where `total` came from, for the reader."""

    @property
    def usable(self) -> float:
        return self.total * (1 - self.headroom)


@dataclass(frozen=True)
class StrategyPlan:
    name: str
    layout: Layout
    bpp: BytesPerParam
    held: dict[str, dict[str, float]]
    """Model state per rank: {place: {kind: bytes}}."""
    gathered: float
    activations: float
    comm_bytes: float
    comm_seconds: float

    def on(self, place: str) -> float:
        return sum(self.held[place].values())

    @property
    def peak_device(self) -> float:
        """Model state on the device + the gathered layer + activations (without checkpointing)."""
        return self.on("device") + self.gathered + self.activations

    @property
    def offload_depth(self) -> int:
        """How far its state travels from the device: 0 per kind on the device, 1 in host memory, 2 on NVMe."""
        layout = self.layout
        return sum(PLACES.index(p.where) for p in (layout.params, layout.grads, layout.optimizer))

    @property
    def sharded(self) -> int:
        layout = self.layout
        return sum(p.sharded for p in (layout.params, layout.grads, layout.optimizer))


@dataclass(frozen=True)
class Plan:
    model: ModelSize
    model_target: str
    precision: str
    optimizer: str
    moments: int
    seq_len: int
    micro: int
    global_size: int
    derived: Derived
    activations: float
    """Bytes per rank without checkpointing; 0 when the model is not the built-in GPT."""
    activations_checkpointed: float
    gpt: bool
    """The activation formula applies (the built-in GPT)."""
    device: DeviceMemory
    link_gbps: float
    internode_gbps: float
    strategies: list[StrategyPlan]

    @property
    def gbps(self) -> float:
        return bound_gbps(self.link_gbps, self.internode_gbps, self.derived.nodes)

    def for_strategy(self, name: str, layout: Layout, world_size: int | None = None, micro: int | None = None) -> StrategyPlan:
        """One strategy's figures; another world size or micro-batch answers `what would fit`."""
        world = world_size or self.derived.world_size
        bpp = bytes_per_param(self.precision, self.moments, layout.master_weights)
        accumulation = self.global_size // ((micro or self.micro) * world) or 1
        sent = step_comm_bytes(self.model.params, world, layout, self.precision, accumulation)
        return StrategyPlan(
            name=name,
            layout=layout,
            bpp=bpp,
            held=per_rank_bytes(self.model.params, bpp, layout, world),
            gathered=gathered_bytes(self.model.largest_layer, bpp.weights, layout.params.sharded),
            activations=self.activations * (micro or self.micro) / self.micro,  # linear in the micro-batch
            comm_bytes=sent,
            comm_seconds=comm_seconds(sent, self.gbps),
        )

    def ranked(self) -> list[StrategyPlan]:
        """Least communication first. At equal volume the simplest layout: less offload (host copies are
        slow), then less sharding (each adds bookkeeping the volume does not show), then by name."""
        return sorted(self.strategies, key=lambda sp: (sp.comm_bytes, sp.offload_depth, sp.sharded, sp.name))

    def fits(self, sp: StrategyPlan) -> bool:
        return sp.peak_device <= self.device.usable

    def pick(self, blocked: Collection[str] = ()) -> StrategyPlan | None:
        """strategy=auto's choice: the first in `ranked` order that fits, among those not `blocked` (refused by their checks)."""
        return next((sp for sp in self.ranked() if self.fits(sp) and sp.name not in blocked), None)


def _name(value: Any) -> str:
    """Enum members (a composed config) and their names (a frozen one) read the same."""
    return value.name if isinstance(value, Enum) else str(value)


@contextmanager
def _no_init_on_meta() -> Iterator[None]:
    """Skip `torch.nn.init` calls on meta tensors: they have no values to fill. (torch routes a meta `normal_`
    through a decomposition whose first use imports torch._dynamo: seconds of `launch plan`'s budget.)"""
    import torch
    from torch.overrides import TorchFunctionMode

    class NoInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            tensor = args[0] if args else kwargs.get("tensor")
            if getattr(func, "__module__", "") == "torch.nn.init" and isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return func(*args, **kwargs)

    with torch.device("meta"), NoInit():
        yield


# The model fields the activation formula reads; each is a size and must be positive.
GPT_SIZES = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


def measure_model(model_cfg: DictConfig) -> ModelSize:
    """Count parameters on a model built on the meta device: nothing allocated, nothing initialised."""
    from hydra.utils import instantiate

    for key in GPT_SIZES:
        if key in model_cfg:
            _positive(f"model.{key}", model_cfg[key])
    try:
        with _no_init_on_meta():
            model = instantiate(model_cfg)
    except Exception as e:  # the model's own one-line complaint, not Hydra's wrapper
        cause = e.__cause__ or e
        raise ConfigError(f"model {model_cfg.get('_target_')} could not be built: {cause}") from e
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied parameter once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ModelSize(params, largest)


def check_plan_config(plan: DictConfig) -> None:
    for key in ("link_gbps", "internode_gbps"):
        if plan[key] <= 0:
            raise ConfigError(f"plan.{key}={plan[key]} is invalid: it must be > 0 (GB/s per GPU)")
    if plan.device_memory_gb is not None and plan.device_memory_gb <= 0:
        raise ConfigError(f"plan.device_memory_gb={plan.device_memory_gb} is invalid: it must be > 0 (GB per device), "
                          "or unset to detect it")
    if not 0 <= plan.headroom < 1:
        raise ConfigError(f"plan.headroom={plan.headroom} is invalid: it is the fraction kept free, 0 <= headroom < 1")


def device_memory(plan: DictConfig) -> DeviceMemory:
    """plan.device_memory_gb when set; else the free memory of the first visible GPU; else 80 GB."""
    if plan.device_memory_gb is not None:
        return DeviceMemory(plan.device_memory_gb * GB, plan.headroom, "plan.device_memory_gb")
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        return DeviceMemory(float(free), plan.headroom, "free on cuda:0")
    return DeviceMemory(DEFAULT_DEVICE_MEMORY_GB * GB, plan.headroom,
                        f"no GPU visible: {DEFAULT_DEVICE_MEMORY_GB:.0f} GB assumed; set plan.device_memory_gb")


def make_plan(cfg: DictConfig, derived: Derived, layouts: dict[str, Layout]) -> Plan:
    """The plan of a composed config (model, optimizer, precision, batch, plan.*) for each named strategy layout."""
    check_plan_config(cfg.plan)
    model = cfg.model
    size = measure_model(model)
    seq = OmegaConf.select(cfg, "data.seq_len", default=None) or OmegaConf.select(model, "block_size", default=1)
    precision = _name(cfg.precision)
    elem = 2 if precision in MIXED_PRECISIONS else 4
    gpt = model._target_ == GPT_TARGET
    activations = checkpointed = 0.0
    if gpt:
        shape = dict(seq=seq, micro=cfg.batch.micro_size, hidden=model.n_embd, heads=model.n_head,
                     layers=model.n_layer, vocab=model.vocab_size, elem=elem)
        activations, checkpointed = activation_bytes(**shape), activation_bytes(**shape, checkpointing=True)
    optim = cfg.optim
    plan = Plan(
        model=size,
        model_target=str(model._target_),
        precision=precision,
        optimizer=str(optim._target_),
        moments=optimizer_moments(str(optim._target_), float(OmegaConf.select(optim, "momentum", default=0.0) or 0.0)),
        seq_len=int(seq),
        micro=cfg.batch.micro_size,
        global_size=cfg.batch.global_size,
        derived=derived,
        activations=activations,
        activations_checkpointed=checkpointed,
        gpt=gpt,
        device=device_memory(cfg.plan),
        link_gbps=cfg.plan.link_gbps,
        internode_gbps=cfg.plan.internode_gbps,
        strategies=[],
    )
    return replace(plan, strategies=[plan.for_strategy(name, layout) for name, layout in layouts.items()])


def what_would_fit(plan: Plan, blocked: dict[str, str]) -> list[str]:
    """When nothing fits: more GPUs, offload, or a smaller micro-batch — each with the strategy it would take."""
    d, found = plan.derived, []
    refused = [sp.name for sp in plan.ranked() if plan.fits(sp) and sp.name in blocked]  # offload, typically
    if refused:
        found.append(f"{', '.join(refused)} (their own checks refuse them here; see why above)")
    for nodes in range(d.nodes + 1, MAX_NODES + 1):  # more GPUs: sharded state shrinks as 1/G
        fitting = [sp for sp in plan.ranked() if sp.name not in blocked
                   if plan.fits(plan.for_strategy(sp.name, sp.layout, world_size=nodes * d.gpus))]
        if fitting:
            multiple = plan.micro * nodes * d.gpus  # the batch contract at that world size
            batch = f" and batch.global_size a multiple of {multiple}" if plan.global_size % multiple else ""
            found.append(f"more GPUs: nodes={nodes} ({nodes * d.gpus} GPUs){batch} with {fitting[0].name}")
            break
    for micro in range(plan.micro - 1, 0, -1):  # a smaller micro-batch: activations shrink linearly
        if plan.global_size % (micro * d.world_size):
            continue  # the batch contract: global = micro x accumulation x world size
        fitting = [sp for sp in plan.ranked() if sp.name not in blocked
                   if plan.fits(plan.for_strategy(sp.name, sp.layout, micro=micro))]
        if fitting:
            found.append(f"batch.micro_size={micro} (accumulation {plan.global_size // (micro * d.world_size)}) "
                         f"with {fitting[0].name}")
            break
    return found


# ============================================================================================
# 3. Output and entry points
# ============================================================================================

WHERE = {"device": "device", "cpu": "host", "nvme": "nvme"}
"""Printed names of the places: host memory is Placement.where == "cpu"."""


UNITS = (("GB", GB), ("MB", 1e6), ("kB", 1e3))


def _unit(largest: float) -> tuple[str, float]:
    """The largest unit in which `largest` bytes reads as at least 1 (a tiny model's plan in MB, not 0.00 GB)."""
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def _size(nbytes: float) -> str:
    unit, size = _unit(nbytes)
    return f"{nbytes / size:.2f} {unit}"


def _placement(p: Placement) -> str:
    return ("1/G" if p.sharded else "full") + ("" if p.where == "device" else f" {WHERE[p.where]}")


def as_dict(plan: Plan) -> dict[str, Any]:
    """The plan for scripts (plan.format=json): bytes, seconds, counts."""
    d, pick = plan.derived, plan.pick()
    return {
        "model": {"target": plan.model_target, "params": plan.model.params, "largest_layer_params": plan.model.largest_layer},
        "precision": plan.precision,
        "optimizer": {"target": plan.optimizer, "moments": plan.moments},
        "batch": {"micro": plan.micro, "accumulation": d.accumulation, "world_size": d.world_size,
                  "gpus": d.gpus, "nodes": d.nodes, "global": plan.global_size},
        "activations": {"seq_len": plan.seq_len, "bytes": plan.activations if plan.gpt else None,
                        "checkpointed_bytes": plan.activations_checkpointed if plan.gpt else None},
        "device_memory": {"bytes": plan.device.total, "usable_bytes": plan.device.usable,
                          "headroom": plan.device.headroom, "source": plan.device.source},
        "link": {"gbps": plan.link_gbps, "internode_gbps": plan.internode_gbps, "bound_gbps": plan.gbps},
        "strategies": [
            {
                "name": sp.name,
                "layout": {kind: {"sharded": p.sharded, "where": WHERE[p.where]} for kind, p in
                           (("params", sp.layout.params), ("grads", sp.layout.grads), ("optimizer", sp.layout.optimizer))},
                "bytes_per_param": {kind: getattr(sp.bpp, kind) for kind in KINDS},
                "state_bytes": {WHERE[place]: sp.held[place] for place in PLACES},
                "device_state_bytes": sp.on("device"),
                "host_state_bytes": sp.on("cpu"),
                "nvme_state_bytes": sp.on("nvme"),
                "gathered_bytes": sp.gathered,
                "activation_bytes": sp.activations,
                "peak_device_bytes": sp.peak_device,
                "fits": plan.fits(sp),
                "comm_bytes": sp.comm_bytes,
                "comm_seconds": sp.comm_seconds,
            }
            for sp in plan.strategies
        ],
        "auto": pick.name if pick else None,
    }


def _header(plan: Plan) -> list[str]:
    d, m = plan.derived, plan.model
    first = plan.strategies[0].bpp if plan.strategies else bytes_per_param(plan.precision, plan.moments)
    moments = f"{plan.moments} x fp32" if plan.moments else "none"
    weights = plan.precision if plan.precision in MIXED_PRECISIONS else "fp32"
    master = ("master 4 (fp32)" if plan.precision in MIXED_PRECISIONS
              else "master 0 (4 where the strategy's optimizer keeps its own fp32 copy: DeepSpeed)")
    optimizer = plan.optimizer.rsplit(".", 1)[-1]
    lines = [
        f"model        {plan.model_target}: {m.params:,} parameters (counted on the meta device), "
        f"largest layer {m.largest_layer:,}",
        f"bytes/param  {plan.precision} + {optimizer}: weights {first.weights} ({weights}) + {master} + grads 4 (fp32) + "
        f"moments {4 * plan.moments} ({moments}) = {bytes_per_param(plan.precision, plan.moments).total}",
        f"batch        micro {plan.micro} x accumulation {d.accumulation} x world {d.world_size} "
        f"({d.nodes} node(s) x {d.gpus} GPUs) = global {plan.global_size}",
    ]
    if plan.gpt:
        lines.append(f"activations  per rank, micro-batch {plan.micro} x seq {plan.seq_len}: {_size(plan.activations)}; "
                     f"with activation checkpointing {_size(plan.activations_checkpointed)} (Korthikanti et al. 2022)")
    else:
        lines.append(f"activations  not estimated: the formula is for the built-in GPT ({GPT_TARGET})")
    lines.append(f"device       {_size(plan.device.total)} ({plan.device.source}), headroom {plan.device.headroom:.0%}: "
                 f"{_size(plan.device.usable)} usable")
    link = f"{plan.link_gbps:g} GB/s per GPU within a node"
    if d.nodes > 1:
        link += f", {plan.internode_gbps:g} GB/s between nodes: rings run at {plan.gbps:g} GB/s"
    lines.append(f"link         {link}")
    return lines


def _table(groups: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell (first left-aligned, others right), under group titles spanning them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    spans, column = [], 0
    for title, n in groups:  # widen a group's last column until its title fits over it
        span = sum(widths[column:column + n]) + 2 * (n - 1)
        widths[column + n - 1] += max(0, len(title) - span)
        spans.append(title.center(sum(widths[column:column + n]) + 2 * (n - 1)))
        column += n
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    return ["  ".join(spans).rstrip(), *lines]


def strategy_rows(plan: Plan, blocked: Collection[str] = (), compact: bool = False) -> list[str]:
    """One line per strategy, side by side: its layout, model state per rank by kind (`host`/`nvme`: offloaded
    there) and by place, peak device memory, communication per step; * marks auto's pick. `compact`: only
    what auto decides on."""
    pick = plan.pick(blocked)
    unit, size = _unit(max(max(sp.peak_device, sp.on("cpu"), sp.on("nvme"), sp.comm_bytes) for sp in plan.strategies))

    def amount(nbytes: float) -> str:
        return f"{nbytes / size:.2f}"

    rows, groups = [], []
    for sp in plan.strategies:
        fits = "yes" if plan.fits(sp) else "no"
        if sp.name in blocked:
            fits += " (refused)"
        name = ("* " if sp is pick else "  ") + sp.name
        comm = [amount(sp.comm_bytes), f"{sp.comm_seconds * 1e3:.3g}"]
        if compact:
            rows.append([name, amount(sp.peak_device), fits, *comm])
            continue
        where = {"weights": sp.layout.params.where, "master": sp.layout.optimizer.where,
                 "grads": sp.layout.grads.where, "moments": sp.layout.optimizer.where}
        kinds = [amount(sp.held[where[k]][k]) + ("" if where[k] == "device" else f" {WHERE[where[k]]}") for k in KINDS]
        rows.append([name, _placement(sp.layout.params), _placement(sp.layout.grads), _placement(sp.layout.optimizer),
                     *kinds, amount(sp.on("device")), amount(sp.on("cpu")), amount(sp.on("nvme")),
                     amount(sp.gathered), amount(sp.peak_device), fits, *comm])
    if compact:
        groups = [("", 1), (f"per device, {unit}", 2), ("comm per step", 2)]
        header = ["strategy", "peak", "fits", unit, "ms"]
    else:
        groups = [("", 1), ("layout", 3), (f"model state by kind, {unit}", 4), (f"state by place, {unit}", 3),
                  (f"peak per device, {unit}", 3), ("comm per step", 2)]
        header = ["strategy", "params", "grads", "optimizer", *KINDS, "device", "host", "nvme", "gathered", "peak",
                  "fits", unit, "ms"]
    return _table(groups, [header, *rows])


def describe_pick(plan: Plan, blocked: dict[str, str] | None = None) -> str:
    """Why auto picks what it picks, or, when nothing fits, what would."""
    blocked = blocked or {}
    pick = plan.pick(blocked)
    if pick is None:
        runnable = [sp for sp in plan.strategies if sp.name not in blocked] or plan.strategies
        smallest = min(runnable, key=lambda sp: sp.peak_device)
        would = what_would_fit(plan, blocked)
        runs = "runnable strategy" if blocked else "strategy"
        return (f"no {runs} fits {_size(plan.device.usable)} per device (the smallest peak, {smallest.name}'s, is "
                f"{_size(smallest.peak_device)}); would fit: {'; '.join(would) or 'nothing found: shrink the model or data.seq_len'}")
    return (f"{pick.name}: the least communication ({_size(pick.comm_bytes)} per rank per step, "
            f"{pick.comm_seconds * 1e3:.3g} ms) whose peak ({_size(pick.peak_device)}) fits {_size(plan.device.usable)} per device")


def render(plan: Plan) -> str:
    notes = [
        "per rank; GB = 1e9 bytes, MB = 1e6. layout: what each strategy's layout() shards (1/G) or keeps whole, and offloads"
        " (host, nvme).",
        "peak = model state on the device + gathered (the largest layer, all-gathered when parameters are sharded)"
        " + activations (without checkpointing).",
        f"comm: bytes each rank sends per optimizer step (ring all-reduce 2(G-1)/G x P; sharded parameters add an"
        f" all-gather in each forward and backward); ms at {plan.gbps:g} GB/s.",
    ]
    if len(plan.strategies) > 1:
        notes.append("* = strategy=auto's pick (unless its checks refuse it at launch): " + describe_pick(plan))
    elif not plan.fits(plan.strategies[0]):
        only = plan.strategies[0].name
        would = "; ".join(what_would_fit(plan, {})) or f"no more GPUs or smaller micro-batch makes {only} fit"
        notes.append(f"{only} does not fit; would fit: {would} (leave strategy= out to compare every strategy)")
    return "\n".join([*_header(plan), "", *strategy_rows(plan), "", *notes])


def chart(plan: Plan, path: str) -> None:
    """Stacked bars of per-rank memory by kind for each strategy: on the device (against the usable
    memory), and offloaded to host memory or NVMe."""
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(f"plan.chart={path} needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # writes a file: no display needed
    import matplotlib.pyplot as plt

    pick = plan.pick()
    names = [sp.name + (" (auto)" if sp is pick else "") for sp in plan.strategies]
    colors = dict(zip([*KINDS, "gathered layer", "activations"], plt.get_cmap("tab10").colors))
    device_layers = [(kind, [sp.held["device"][kind] for sp in plan.strategies], colors[kind], None) for kind in KINDS]
    device_layers += [("gathered layer", [sp.gathered for sp in plan.strategies], colors["gathered layer"], None),
                      ("activations", [sp.activations for sp in plan.strategies], colors["activations"], None)]
    offloaded_layers = [(f"{kind} ({WHERE[place]})", [sp.held[place][kind] for sp in plan.strategies], colors[kind], hatch)
                        for place, hatch in (("cpu", None), ("nvme", "//")) for kind in KINDS]

    fig, (device, offloaded) = plt.subplots(1, 2, figsize=(max(10, 1.5 * len(names) + 4), 5.5), width_ratios=[3, 2])
    for ax, layers, title in ((device, device_layers, "on the device, per rank"),
                              (offloaded, offloaded_layers, "offloaded, per rank (hatched: NVMe)")):
        bottom = [0.0] * len(names)
        for label, values, color, hatch in layers:
            if any(values):
                gb = [v / GB for v in values]
                ax.bar(names, gb, bottom=bottom, label=label, color=color, hatch=hatch, edgecolor="white")
                bottom = [b + v for b, v in zip(bottom, gb)]
        for i, total in enumerate(bottom):  # the figure a reader compares (with the usable line, on the left)
            if total:
                ax.annotate(f"{total:.1f}", (i, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
        ax.set_ylim(0, 1.15 * max(*bottom, plan.device.usable / GB if ax is device else 0, 1e-9))
        ax.set_title(title)
        ax.set_ylabel("GB")
        ax.tick_params(axis="x", rotation=30)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    usable = plan.device.usable / GB
    device.axhline(usable, color="black", linestyle="--", linewidth=1)
    device.annotate(f"usable per device: {usable:.1f} GB", (len(names) - 0.5, usable), xytext=(0, 3),
                    textcoords="offset points", ha="right", fontsize=8)
    d = plan.derived
    fig.suptitle(f"{plan.model.params / 1e9:.2f} B parameters, {plan.precision}, {plan.optimizer.rsplit('.', 1)[-1]}, "
                 f"world size {d.world_size}, micro-batch {plan.micro} x seq {plan.seq_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Composing the strategies to compare: the presets are composed alone, all in one composition (the rest of
# the config is the same for every preset), and each is put in place of the run's strategy, where
# interpolations such as DeepSpeed's `${optim._target_}` resolve against the run's config, as in the run.
# --------------------------------------------------------------------------------------------


def strategy_names() -> list[str]:
    """Every preset in conf/strategy (the config group is the registry), but auto itself."""
    from hydra.core.global_hydra import GlobalHydra

    options = GlobalHydra.instance().config_loader().get_group_options("strategy")
    return [name for name in options if not name.startswith("base_") and name != AUTO]


def _chosen_strategy(overrides: Sequence[str]) -> tuple[str | None, bool]:
    """The strategy the overrides choose (None: compare every preset), and whether they set strategy.* keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e
    chosen, keys = None, False
    for line, o in zip(overrides, parsed):
        if o.is_sweep_override():
            raise ConfigError(f"launch plan takes one value per key, not the sweep {line}; "
                              "leave strategy= out to compare every strategy")
        if o.key_or_group == "strategy" and not o.is_delete():
            chosen = o.get_value_element_as_str()
        keys = keys or o.key_or_group.startswith("strategy.")
    return chosen, keys


def _compose(overrides: Sequence[str], config_name: str | None = "config") -> DictConfig:
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e


def with_presets(cfg: DictConfig, names: Sequence[str]) -> dict[str, DictConfig]:
    """`cfg` with each preset conf/strategy/<name>.yaml as its strategy, by name."""
    import copy

    # One composition of the strategy group alone, each preset at a key of its own: a fifth of the time of
    # composing the whole config once per preset (`launch plan` has 3 s).
    presets = _compose([f"+strategy@{name}={name}" for name in names], config_name=None)
    configs = {}
    for name in names:
        configs[name] = copy.deepcopy(cfg)
        configs[name].strategy = presets[name]
    return configs


def _layouts(configs: dict[str, DictConfig]) -> dict[str, Layout]:
    """Each strategy's own memory rule: constructors take plain values and import nothing heavy."""
    from hydra.utils import instantiate

    return {name: instantiate(c.strategy).layout() for name, c in configs.items()}


def _candidates(cfg: DictConfig) -> dict[str, DictConfig]:
    """strategy=auto's candidates (strategy.candidates, or every preset), each in place of auto in `cfg`."""
    from hydra.utils import instantiate

    presets = strategy_names()
    names = instantiate(cfg.strategy).candidates or presets
    for name in names:
        if name not in presets:
            raise ConfigError(f"strategy.candidates: unknown strategy '{name}'; valid: {', '.join(presets)}")
    return with_presets(cfg, names)


def main(overrides: Sequence[str]) -> int:
    """`launch plan [overrides]`, inside an initialised Hydra (cli.py). Starts nothing, writes no run directory."""
    from launcher.launch import visible_cuda_devices

    chosen, strategy_keys = _chosen_strategy(overrides)
    cfg = _compose(overrides)
    check_plan_config(cfg.plan)
    # A plan may be for GPUs this machine lacks: count the GPUs asked for as visible.
    derived = derive(cfg, max(visible_cuda_devices(), cfg.gpus or 0))
    if chosen is None:  # every preset side by side
        if strategy_keys:
            print("launch plan: note: strategy.* overrides apply with strategy=NAME; comparing the presets as they are",
                  file=sys.stderr)
        configs = with_presets(cfg, strategy_names())
    elif is_auto(cfg):  # the candidates auto chooses from
        configs = _candidates(cfg)
    else:
        configs = {chosen: cfg}
    plan = make_plan(cfg, derived, _layouts(configs))
    if cfg.plan.chart:
        chart(plan, str(cfg.plan.chart))
    if _name(cfg.plan.format) == "json":
        print(json.dumps(as_dict(plan), indent=2))
    else:
        print(render(plan))
        if cfg.plan.chart:
            print(f"chart: {Path(str(cfg.plan.chart)).resolve()}")
    return 0


def choose(cfg: DictConfig, cuda_devices: int) -> tuple[str, DictConfig]:
    """strategy=auto, inside the Hydra app: the name and composed config of the strategy with the least communication
    whose per-rank memory fits the device and whose own checks pass. Prints why (one line per candidate);
    raises ConfigError (exit 2) saying what would fit when nothing does."""
    from launcher.launch import check_strategy

    check_plan_config(cfg.plan)
    derived = derive(cfg, cuda_devices)
    configs = _candidates(cfg)
    plan = make_plan(cfg, derived, _layouts(configs))
    blocked: dict[str, str] = {}
    while (pick := plan.pick(blocked)) is not None:  # the best that fits, unless its own checks refuse it here
        frozen = OmegaConf.create({**OmegaConf.to_container(configs[pick.name], resolve=True, enum_to_str=True),  # type: ignore[dict-item]
                                   "derived": derived.as_dict()})
        try:
            check_strategy(frozen)
            break
        except ConfigError as e:
            blocked[pick.name] = str(e)
    print("\n".join(f"auto: {line}" for line in strategy_rows(plan, blocked, compact=True)), flush=True)
    for name, reason in blocked.items():
        print(f"auto: {name} refused: {reason}", flush=True)
    if pick is None:
        raise ConfigError(f"strategy=auto: {describe_pick(plan, blocked)}")
    print(f"auto: picked {describe_pick(plan, blocked)}", flush=True)
    return pick.name, configs[pick.name]
