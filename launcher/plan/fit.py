"""The plan of a frozen config: each strategy's per-rank memory and communication, and whether it fits.

Each strategy's `layout()` says what it shards and offloads, its `collectives()` what it sends (the planner keeps
no table of strategy rules);
`derive()` gives the batch; `launcher.models.meta` gives the model's size. `what_would_fit` searches more GPUs and
smaller micro-batches when nothing fits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError, Derived
from launcher.models.meta import ModelSize
from launcher.plan.costs import (
    GB,
    GPT_TARGET,
    MIXED_PRECISIONS,
    PLACES,
    BytesPerParam,
    activation_bytes,
    bound_gbps,
    bytes_per_param,
    gathered_bytes,
    optimizer_moments,
    per_rank_bytes,
    split_comm_seconds,
    strategy_comm,
    tensor_rank_params,
    transient_bytes,
)
from strategies.base import Strategy
from strategies.declarations import Layout

DEFAULT_DEVICE_MEMORY_GB = 80.0
"""Assumed per-device memory when no GPU is visible and plan.device_memory_gb is unset (A100/H100 80 GB)."""
HOST_PER_DEVICE = 2.0
"""Assumed host memory per byte of its GPUs' memory on a node planned from a machine without GPUs: GPU nodes carry
2 to 3.6 times it (8 x 80 GB: 1.24 TB on AWS p4de, 2 TB on a DGX H100); the low end, so that a plan does not promise
what a node lacks."""
MAX_NODES = 4096
"""How far `what would fit` looks for more nodes."""


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
class NodeSpace:
    """What a node has beyond its devices, shared by its ranks: host memory, or NVMe space."""

    total: float | None
    """Bytes per node; None: unknown, not checked."""
    source: str
    """Where `total` came from, for the reader."""


@dataclass(frozen=True)
class Shortfall:
    """Why a strategy does not fit: one limit it exceeds."""

    limit: str
    """The device's memory, the host's, or NVMe space."""
    need: float
    usable: float
    per: str
    """What `need` and `usable` are counted over: a device, or a node (its ranks together)."""

    @property
    def over(self) -> float:
        return self.need - self.usable


@dataclass(frozen=True)
class StrategyPlan:
    name: str
    strategy: Strategy
    """What the figures come from: its `layout()` and its declared `collectives()`."""
    layout: Layout
    bpp: BytesPerParam
    held: dict[str, dict[str, float]]
    """Model state per rank: {place: {kind: bytes}}."""
    gathered: float
    """The largest layer's gathered weights and gradient when parameters are sharded (DeepSpeed's definition)."""
    transient: float
    """Beyond the model state at the peak, by the strategy's own rule (`Layout.transients`)."""
    activations: float
    comm_bytes: float
    comm_seconds: float
    shards: int = 1
    """Ranks each sharded kind is split over: the world size, or an HSDP shard group's size."""
    internode_bytes: float = 0.0
    """Of `comm_bytes`, what rings crossing nodes carry (`comm_split`): all of it for a ring over every rank,
    HSDP's all-reduce across its replicas only."""
    export: float = 0.0
    """Host memory a checkpoint save needs beyond the state (DeepSpeed's export of its full-copy share)."""

    def on(self, place: str) -> float:
        return sum(self.held[place].values())

    @property
    def peak_device(self) -> float:
        """Model state on the device + the strategy's transient buffers + activations (without checkpointing)."""
        return self.on("device") + self.transient + self.activations

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
    host: NodeSpace
    """Host memory of a planned node, shared by its ranks (with headroom `device.headroom`)."""
    nvme: NodeSpace
    """NVMe space of a planned node, shared by its ranks."""
    link_gbps: float
    internode_gbps: float
    strategies: list[StrategyPlan]
    ema: bool = False
    """trainer.ema.decay is set: the EMA weights are model state too."""

    @property
    def gbps(self) -> float:
        return bound_gbps(self.link_gbps, self.internode_gbps, self.derived.nodes)

    def for_strategy(
        self, name: str, strategy: Strategy, world_size: int | None = None, micro: int | None = None
    ) -> StrategyPlan:
        """One strategy's figures; another world size or micro-batch answers `what would fit`."""
        world, gpus, layout = world_size or self.derived.world_size, self.derived.gpus, strategy.layout()
        try:
            _, shards = layout.mesh.groups(world, gpus)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        bpp = bytes_per_param(
            self.precision, self.moments, layout.master_weights, layout.low_precision_weights, self.ema
        )
        accumulation = self.global_size // ((micro or self.micro) * world // layout.mesh.tensor_size) or 1
        params, unit = self.model.params, self.model.largest_unit or self.model.params
        split = self.model.tensor_split
        # What a rank of a tensor-parallel group holds of the model (all of it where T = 1), then sharded over `shards`.
        held = per_rank_bytes(tensor_rank_params(params, split, layout.mesh.tensor_size), bpp, layout, shards)
        gathered = gathered_bytes(self.model.largest_layer, bpp.weights, layout.params.sharded)
        grads_share = 1 / shards if layout.grads.sharded else 0.0
        transient = transient_bytes(
            layout.transients,
            tensor_rank_params(params, split, layout.mesh.tensor_size),
            unit,
            self.precision,
            accumulation,
            grads_share,
            grad_bytes=bpp.weights,
        )
        within, across = strategy_comm(
            strategy, params, self.precision, accumulation, world, gpus, self.model.gathered, split, self.model.reused
        )
        return StrategyPlan(  # the fields in their order: name, strategy, layout, bpp, held, gathered, transient
            name,
            strategy,
            layout,
            bpp,
            held,
            gathered,
            transient,
            activations=self.activations * (micro or self.micro) / self.micro,  # linear in the micro-batch
            comm_bytes=within + across,
            comm_seconds=split_comm_seconds(within, across, self.link_gbps, self.internode_gbps),
            shards=shards,
            internode_bytes=across,
            export=(4 + 4 * self.moments) * params / shards if layout.master_weights else 0.0,
        )

    def ranked(self) -> list[StrategyPlan]:
        """Least communication first, by the measures of `RANKING` in turn."""
        return sorted(self.strategies, key=lambda sp: tuple(key(sp) for _, _, key in RANKING))

    def decided_by(self, pick: StrategyPlan, blocked: Collection[str] = ()) -> tuple[int, StrategyPlan | None]:
        """The index in `RANKING` of the measure that puts `pick` before the next strategy that fits (not `blocked`),
        and that one; 0 when no other fits."""
        tp = pick.strategy.requirements().model_plan  # tensor parallel comes after every other that fits (`pick`)
        later = [
            sp
            for sp in self.ranked()
            if sp is not pick
            and sp.name not in blocked
            and self.fits(sp)
            and sp.strategy.requirements().model_plan <= tp
        ]
        if not later:
            return 0, None
        return next(i for i, (_, _, key) in enumerate(RANKING) if key(pick) != key(later[0])), later[0]

    def peak(self, sp: StrategyPlan) -> float:
        """A rank's peak where its device's memory is: on the device; with `device=cpu` (the device is the host)
        also the state it offloads to host memory."""
        return sp.peak_device + (sp.on("cpu") if self.derived.device == "cpu" else 0.0)

    def need(self, sp: StrategyPlan) -> float:
        """What a rank needs of its device's memory: the step's peak; with `device=cpu` (the device is the host) the
        larger of that and a save's (its whole state plus a DeepSpeed save's export, which exists only then)."""
        if self.derived.device == "cpu":
            return max(self.peak(sp), sp.on("device") + sp.on("cpu") + sp.export)
        return sp.peak_device

    def host_need(self, sp: StrategyPlan) -> float:
        """Host memory a node's ranks need together: their offloaded state and a DeepSpeed save's export."""
        return self.derived.gpus * (sp.on("cpu") + sp.export)

    def shortfalls(self, sp: StrategyPlan) -> list[Shortfall]:
        """Where each byte lives, each limit it exceeds: the device's need against the device's memory; host memory
        (offloaded state, a DeepSpeed save's export) against the node's, shared by its ranks; NVMe state against the
        node's NVMe space where known. With `device=cpu` the device is the host: everything a rank holds against its
        share."""
        short = []
        if self.need(sp) > self.device.usable:
            short.append(Shortfall("device memory", self.need(sp), self.device.usable, "per device"))
        host, gpus = self.host.total, self.derived.gpus
        if self.derived.device != "cpu" and host is not None and self.host_need(sp) > host * (1 - self.device.headroom):
            usable = host * (1 - self.device.headroom)
            short.append(Shortfall("host memory", self.host_need(sp), usable, f"per node of {gpus} ranks"))
        if self.nvme.total is not None and gpus * sp.on("nvme") > self.nvme.total:
            short.append(Shortfall("NVMe space", gpus * sp.on("nvme"), self.nvme.total, f"per node of {gpus} ranks"))
        return short

    def fits(self, sp: StrategyPlan) -> bool:
        return not self.shortfalls(sp)

    def pick(self, blocked: Collection[str] = ()) -> StrategyPlan | None:
        """strategy=auto's choice: the first in `ranked` order that fits, among those not `blocked` (refused by
        their checks); tensor parallel only where nothing else fits (its traffic grows with the tokens;
        `launcher.plan.tensor.with_tensor` adds it where the model is at hand)."""
        fitting = [sp for sp in self.ranked() if self.fits(sp) and sp.name not in blocked]
        return min(fitting, key=lambda sp: sp.strategy.requirements().model_plan, default=None)  # stable: ranked


RANKING: tuple[tuple[str, str, Callable[[StrategyPlan], float | str]], ...] = (
    ("time", "the least communication time", lambda sp: sp.comm_seconds),  # across nodes at that link's pace
    ("bytes", "fewer bytes sent", lambda sp: sp.comm_bytes),
    ("offload", "less offload", lambda sp: sp.offload_depth),  # host copies are slow
    ("sharding", "less sharding", lambda sp: sp.sharded),  # each adds bookkeeping the volume does not show
    ("name", "name", lambda sp: sp.name),
)
"""strategy=auto's order: (measure, what it prefers, key), each deciding where those before it tie; the pick's line
names the one that decided."""


def _gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def host_memory(plan: DictConfig, derived: Derived, device_gb: float, available: float) -> NodeSpace:
    """plan.host_memory_gb when set; this machine's available memory with device=cpu or on a node (a GPU visible);
    else a typical node for the GPUs planned, `HOST_PER_DEVICE` times their `device_gb` each."""
    if plan.host_memory_gb is not None:
        return NodeSpace(plan.host_memory_gb * GB, "plan.host_memory_gb")
    if derived.device == "cpu" or _gpu_visible():
        return NodeSpace(available or None, "available on this machine" if available else "unknown: not checked")
    return NodeSpace(
        HOST_PER_DEVICE * derived.gpus * device_gb * GB,
        f"no GPU visible: a typical node for {derived.gpus} GPUs of {device_gb:g} GB assumed, {HOST_PER_DEVICE:g} GB "
        "per GB of theirs; set plan.host_memory_gb",
    )


def nvme_space(plan: DictConfig) -> NodeSpace:
    if plan.nvme_gb is not None:
        return NodeSpace(plan.nvme_gb * GB, "plan.nvme_gb")
    return NodeSpace(None, "not checked by the plan (a launch checks strategy.nvme_path); set plan.nvme_gb")


def device_memory(plan: DictConfig, derived: Derived, host: float | None) -> DeviceMemory:
    """plan.device_memory_gb when set; for device=cpu this rank's share of the host's memory (`host` bytes per node);
    else the free memory of the first visible GPU; else 80 GB (planning for GPUs this machine lacks)."""
    if plan.device_memory_gb is not None:
        return DeviceMemory(plan.device_memory_gb * GB, plan.headroom, "plan.device_memory_gb")
    if derived.device == "cpu" and host:
        share = host / derived.gpus
        source = f"device=cpu: the host's {host / GB:.2f} GB, shared by {derived.gpus} ranks"
        return DeviceMemory(share, plan.headroom, source)
    if _gpu_visible():
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        return DeviceMemory(float(free), plan.headroom, "free on cuda:0")
    return DeviceMemory(
        DEFAULT_DEVICE_MEMORY_GB * GB,
        plan.headroom,
        f"no GPU visible: {DEFAULT_DEVICE_MEMORY_GB:.0f} GB assumed; set plan.device_memory_gb",
    )


def make_plan(cfg: DictConfig, derived: Derived, size: ModelSize, strategies: dict[str, Strategy]) -> Plan:
    """The plan of a frozen config (model, optimizer, precision, batch, plan.*) for each named strategy."""
    from launcher.base.machine import memory_available

    _, available = memory_available()
    if derived.device == "cpu":  # the device is the host
        host = host_memory(cfg.plan, derived, 0.0, available)
        device = device_memory(cfg.plan, derived, host.total)
    else:
        device = device_memory(cfg.plan, derived, None)
        host = host_memory(cfg.plan, derived, device.total / GB, available)
    model = cfg.model
    seq = OmegaConf.select(cfg, "data.seq_len", default=None) or OmegaConf.select(model, "block_size", default=1)
    precision = str(cfg.precision)
    elem = 2 if precision in MIXED_PRECISIONS else 4
    gpt = model._target_ == GPT_TARGET
    activations = checkpointed = 0.0
    if gpt:
        shape = dict(
            seq=seq,
            micro=cfg.batch.micro_size,
            hidden=model.n_embd,
            heads=model.n_head,
            layers=model.n_layer,
            vocab=model.vocab_size,
            elem=elem,
        )
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
        device=device,
        host=host,
        nvme=nvme_space(cfg.plan),
        link_gbps=cfg.plan.link_gbps,
        internode_gbps=cfg.plan.internode_gbps,
        strategies=[],
        ema=OmegaConf.select(cfg, "trainer.ema.decay", default=None) is not None,
    )
    return replace(plan, strategies=[plan.for_strategy(name, s) for name, s in strategies.items()])


def _fits(plan: Plan, sp: StrategyPlan, world_size: int | None = None, micro: int | None = None) -> bool:
    """Whether a strategy would fit at another world size or micro-batch (not where its mesh does not tile it)."""
    try:
        return plan.fits(plan.for_strategy(sp.name, sp.strategy, world_size, micro))
    except ConfigError:
        return False


def what_would_fit(plan: Plan, blocked: dict[str, str]) -> list[str]:
    """When nothing fits: more GPUs, offload, or a smaller micro-batch — each with the strategy it would take."""
    d, found = plan.derived, []
    refused = [sp.name for sp in plan.ranked() if plan.fits(sp) and sp.name in blocked]  # offload, typically
    if refused:
        found.append(f"{', '.join(refused)} (their own checks refuse them here; see why above)")
    for nodes in range(d.nodes + 1, MAX_NODES + 1):  # more GPUs: sharded state shrinks as 1/G
        fitting = [sp for sp in plan.ranked() if sp.name not in blocked if _fits(plan, sp, world_size=nodes * d.gpus)]
        if fitting:
            multiple = plan.micro * nodes * d.gpus  # the batch contract at that world size
            batch = f" and batch.global_size a multiple of {multiple}" if plan.global_size % multiple else ""
            found.append(f"more GPUs: nodes={nodes} ({nodes * d.gpus} GPUs){batch} with {fitting[0].name}")
            break
    for micro in range(plan.micro - 1, 0, -1):  # a smaller micro-batch: activations shrink linearly
        if plan.global_size % (micro * d.world_size):
            continue  # the batch contract: global = micro x accumulation x world size
        fitting = [sp for sp in plan.ranked() if sp.name not in blocked if _fits(plan, sp, micro=micro)]
        if fitting:
            found.append(
                f"batch.micro_size={micro} (accumulation {plan.global_size // (micro * d.world_size)}) "
                f"with {fitting[0].name}"
            )
            break
    return found
