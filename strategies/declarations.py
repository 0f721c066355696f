"""What a strategy declares of itself, as plain data, beside the code that runs it: its memory rule (`Layout`), its
collectives per optimizer step (`Collective`), what it needs of the machine (`Requirements`) and what the
conformance suite expects of it (`Conformance`). The planner, the strategy's communication counter, the smoke and
strategies sweeps and the conformance suite all read these; none keeps a table of strategies of its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where one kind of model state lives, and whether each rank holds all of it or 1/G."""

    sharded: bool
    where: str = "device"
    """device | cpu | nvme"""


@dataclass(frozen=True)
class Mesh:
    """The ranks as `replicate` x `shard` (FSDP2's 2-D device mesh, HSDP): sharded state is split 1/shard within
    each group of `shard` consecutive ranks and replicated across the `replicate` groups. One group
    (replicate_size=1, the default) is plain sharding over every rank: FSDP, ZeRO."""

    shard_size: int | None = None
    """Ranks a sharded kind is split over; None: the world size / replicate_size, or with both unset the GPUs of a
    node (then each node is one shard group and the nodes are replicas)."""
    replicate_size: int | None = 1
    """Shard groups holding replicas of each other; None: the world size / shard_size."""
    tensor_size: int = 1
    """The mesh's last dimension, tensor parallel: consecutive ranks splitting each planned layer and seeing the same
    micro-batches. The data-parallel ranks (replicate x shard) are the world size / tensor_size."""

    def groups(self, world_size: int, gpus: int | None = None) -> tuple[int, int]:
        """(replicate, shard) of the data-parallel ranks, for `world_size` ranks of `gpus` per node (None: one node);
        ValueError (one line: the bad value and the fix) when the sizes do not tile the world."""
        if world_size % self.tensor_size:
            sizes = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ValueError(
                f"strategy.tp_size={self.tensor_size} does not divide the world size {world_size} (nodes x gpus); "
                f"use one of {sizes}"
            )
        world_size //= self.tensor_size
        gpus = None if gpus is None else max(1, gpus // self.tensor_size)
        shard, replicate = self.shard_size, self.replicate_size
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        for key, size in (("shard_size", shard), ("replicate_size", replicate)):
            if size is not None and world_size % size:
                raise ValueError(
                    f"strategy.{key}={size} does not divide the world size {world_size} (nodes x gpus); "
                    f"use one of {divisors}, or leave it null to derive it"
                )
        if shard is None:
            shard = world_size // replicate if replicate is not None else (gpus or world_size)
        replicate = world_size // shard if replicate is None else replicate
        if replicate * shard != world_size:
            raise ValueError(
                f"strategy.replicate_size={replicate} x strategy.shard_size={shard} is {replicate * shard} ranks, "
                f"not the world size {world_size}; set one of them to null to derive it from the other"
            )
        return replicate, shard


@dataclass(frozen=True)
class Transients:
    """What a rank holds at its peak beyond its model state, in buffers the size of the whole model (`model_*`) or of
    its largest unit (`unit_*`, FSDP's and ZeRO-3's gathering unit), counted in weights (the dtype the forward
    reads) or in gradients (their reduction dtype)."""

    mixed_weight_copies: float = 0.0
    """Whole-model copies in the compute dtype that exist only under mixed precision (autocast's casts of fp32
    weights, kept for the backward)."""
    model_grads: float = 0.0
    """Whole-model gradient buffers, in any step: DeepSpeed's reduce buckets (each 1/8 of the model)."""
    full_grads: float = 0.0
    """Whole-model gradients held through the backward beyond the state's own: ZeRO-1 reduces only at its end. A
    sharded strategy's full gradients replace the 1/G shard its state counts."""
    full_grads_accumulating: float = 0.0
    """The same, while micro-steps accumulate without synchronising (K > 1): unsharded gradients (FSDP, ZeRO),
    DDP's gradients outside its buckets."""
    unit_weights: float = 0.0
    unit_grads: float = 0.0


@dataclass(frozen=True)
class Layout:
    """A strategy's memory rule: the planner and the conformance suite both read it."""

    params: Placement
    grads: Placement
    optimizer: Placement
    """Optimizer moments, and fp32 master weights where the strategy keeps them."""
    master_weights: bool = False
    """The optimizer keeps its own fp32 copy of the parameters (placed like its state), even in fp32 training."""
    low_precision_weights: bool = False
    """Under mixed precision its stored weights are in the compute dtype (DeepSpeed); otherwise they stay fp32 and
    the compute dtype is a transient copy (torch's autocast, FSDP's MixedPrecisionPolicy)."""
    transients: Transients = Transients()
    mesh: Mesh = Mesh()
    """How the sharded kinds are split: over every rank (the default), or within shard groups (HSDP)."""
    flat: bool = False
    """It flattens the parameters into buffers cut into equal parts across ranks (DeepSpeed's ZeRO), rather than
    cutting each parameter by rows (FSDP2's DTensors): no rank holds or gathers one matrix's update whole, so an
    optimizer that updates matrices whole (optim=muon) does not run under it, and the planner adds no gathers of it."""


WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element on the wire, by dtype name."""


@dataclass(frozen=True)
class Collective:
    """One kind of collective a strategy makes in an optimizer step, as it declares it (`Strategy.collectives`): the
    planner sums these, and the conformance suite holds the strategy's own counter (`strategies.comm`) to them."""

    kind: str
    """all_reduce | reduce_scatter | all_gather | reduce | all_to_all (`strategies.comm.RING_PASSES`)."""
    group: str
    """world: every rank; shard: the ranks a sharded kind is split over; replicate: across the shard groups (HSDP)."""
    elements: float
    """The buffer handed to the collective, each time: the whole model's P for a gradient all-reduce (summed over
    its buckets or units), P/S for HSDP's shards."""
    dtype: str
    """What goes on the wire: fp32 | bf16 | fp16 (a bf16 run's fp32 gradients are fp32)."""
    times: int = 1
    """Per optimizer step: 1 for a gradient sync made once, K or 2K for gathers made per micro-step."""
    sync: bool = True
    """A gradient synchronisation (counted in `comm_calls`/`comm_bytes`); False: parameters moved (bytes only)."""

    @property
    def payload_bytes(self) -> float:
        return self.times * self.elements * WIRE_BYTES[self.dtype]


@dataclass(frozen=True)
class Requirements:
    """What a strategy needs of the machine to run (`Strategy.requirements`): the smoke and strategies sweeps leave
    out a preset whose needs are not met here, saying why, and the conformance suite skips it the same way."""

    devices: tuple[str, ...] = ("cpu", "cuda")
    ops: tuple[str, ...] = ()
    """DeepSpeed ops it compiles: cpu_adam (optimizer offload), async_io (NVMe, libaio)."""
    nvme_folder: bool = False
    """A folder to swap into (strategy.nvme_path, or LAUNCH_NVME_PATH)."""
    model_plan: bool = False
    """It splits layers by the model's tensor-parallel plan (strategy.tp_size > 1), which a model may lack: the sweeps
    over any model (smoke, strategies) leave it out, saying so."""
    imports: tuple[str, ...] = ()
    """Modules its workers import to run it: a launcher that forks its CPU workers imports them, and loads `ops`,
    once before the fork, rather than once in every rank."""
    set_up_again: bool = True
    """It can be torn down and set up again in the same process on a new process group, at another world size:
    recovery in place (`launcher.recovery.in_place`). DeepSpeed's engine keeps the groups it was made with."""


@dataclass(frozen=True)
class Conformance:
    """What the conformance suite expects of a strategy (`Strategy.conformance`), on CPU in fp32 with AdamW."""

    tolerance: float = 1e-6
    """The largest loss difference from one process, training and validation losses alike: the only such figure,
    which every test that compares a strategy with one process reads. 1e-6 where the strategy computes one process's
    gradients in another order of fp32 sums (each step's about an ulp, 1e-7; with torch's optimizer or DeepSpeed's
    CPU Adam, offload); more where it rounds what it sends (`lossy`), by the rounding's own account."""
    norm_tolerance: float = 1e-5
    """The largest relative difference of its logged gradient norm from one process's: a sum of squares over every
    parameter, in another order and from weights that moved by the losses' ulps (on the suite's job at most 5.4e-7,
    fsdp_tp's; ddp's 1.1e-7); more where it rounds what it sends."""
    ranks: int = 2
    """The suite's world size for it."""
    overrides: tuple[str, ...] = ()
    """The suite's settings for that run (HSDP's shard group of 2 in 4 ranks)."""
    comm_slack: float = 0.02
    """How far the bytes its counter sees may stray from its declared collectives, relatively: FSDP's and ZeRO's
    padding of each unit to a multiple of the ranks."""
    lossy: bool = False
    """It rounds what it sends (a compressed all-reduce): its losses follow one process's only to `tolerance`, so
    strategy=auto leaves it out unless strategy.candidates names it."""
