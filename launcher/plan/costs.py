"""The planner's arithmetic over plain numbers: bytes per parameter, per-rank bytes, ring collectives, FLOPs,
activations. Small typed functions; the tests call them with the seed lesson's numbers.

Units: parameters and elements are counts; memory is in bytes (GB = 1e9 bytes, as in the lesson's figures);
links are in GB/s per GPU (gigaBYTES per second); times are in seconds. The ring formula itself lives with the
strategies' communication counter (`strategies.comm`), so that what is measured and what is planned are one formula.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from launcher.config import ConfigError
from strategies.comm import ring_sent_elements
from strategies.declarations import WIRE_BYTES, Collective, Layout, Mesh, Transients

GB = 1e9
MIXED_PRECISIONS = ("bf16", "fp16")
KINDS = ("weights", "master", "grads", "moments", "ema")
"""Kinds of model state, in the order they are printed and stacked."""
PLACES = ("device", "cpu", "nvme")
"""Where a kind can live (Placement.where); "cpu" is host memory."""
GPT_TARGET = "launcher.models.gpt.GPT"
"""The built-in GPT: the model the activation formula describes."""


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
    ema: int = 0
    """The EMA weights (trainer.ema.decay): 4, in fp32, held as the parameters are."""

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.moments + self.ema


def bytes_per_param(
    precision: str, moments: int, master_weights: bool = False, low_precision_weights: bool = True, ema: bool = False
) -> BytesPerParam:
    """The mixed-precision rule (bf16/fp16) of a strategy that stores its weights in the compute dtype (DeepSpeed;
    the lesson's rule): 16-bit weights, fp32 master weights, fp32 gradients and fp32 moments — with Adam
    2 + 4 + 4 + 2 x 4 = 18 bytes (the lesson's exercise 1). A strategy that keeps fp32 weights under mixed precision
    (`low_precision_weights=False`: torch's autocast, FSDP's MixedPrecisionPolicy) stores 4 + 4 + 8 = 16, its
    16-bit copies being transient (`transient_bytes`). In fp32 the weights are the master copy, unless the
    strategy's optimizer keeps its own (`Layout.master_weights`: DeepSpeed)."""
    mixed = precision in MIXED_PRECISIONS and low_precision_weights
    return BytesPerParam(
        weights=2 if mixed else 4,
        master=4 if mixed or master_weights else 0,
        grads=4,
        moments=4 * moments,
        ema=4 if ema else 0,
    )


class UnknownOptimizer(ConfigError):
    """An optimizer whose state the planner cannot size: `launch plan` refuses it, a run logs no planned peak."""


def optimizer_moments(target: str, momentum: float = 0.0) -> int:
    """fp32 tensors the optimizer keeps per parameter: Adam/AdamW 2 (first and second moment), SGD 1 with
    momentum and 0 without, Adagrad 1 (its sum of squares). Raises UnknownOptimizer for any other."""
    name = target.rsplit(".", 1)[-1]
    if name in ("Adam", "AdamW", "MuonAdamW"):  # Muon's matrices keep one (its momentum): at most 2
        return 2
    if name == "SGD":
        return 1 if momentum else 0
    if name == "Adagrad":
        return 1
    raise UnknownOptimizer(
        f"optim._target_={target}: the planner knows the state of Adam, AdamW, SGD and Adagrad only; "
        "plan with optim=adamw or optim=sgd"
    )


def per_rank_bytes(params: float, bpp: BytesPerParam, layout: Layout, shards: int) -> dict[str, dict[str, float]]:
    """Bytes of each kind of model state one rank holds, by place: {place: {kind: bytes}}, for `params` parameters (a
    tensor-parallel rank's: `tensor_rank_params`).

    A sharded kind costs 1/`shards` of them on each rank: 1/G, 1/S on an HSDP mesh (S = its shard group's size,
    `Mesh.groups`), the data-parallel ranks' share under tensor parallel; a replicated one all of them. The master
    weights live with the optimizer state: both are what the optimizer steps on.
    """
    placements = {
        "weights": layout.params,
        "master": layout.optimizer,
        "grads": layout.grads,
        "moments": layout.optimizer,
        "ema": layout.params,  # the average is held where and as the parameters are
    }
    held = {place: dict.fromkeys(KINDS, 0.0) for place in PLACES}
    for kind, placement in placements.items():
        held[placement.where][kind] = params * getattr(bpp, kind) / (shards if placement.sharded else 1)
    return held


def gathered_bytes(largest_layer: int, weight_bytes: int, params_sharded: bool) -> float:
    """Device memory for the layer being computed when parameters are sharded: its gathered weights and,
    in backward, its full gradient before the reduce-scatter. DeepSpeed's `largest_layer_memory`
    (4 bytes per parameter of the largest layer in 16-bit). Replicated parameters need no such buffer."""
    return 2 * weight_bytes * largest_layer if params_sharded else 0.0


def transient_bytes(
    transients: Transients,
    params: float,
    unit: float,
    precision: str,
    accumulation: int,
    grads_share: float,
    grad_bytes: int = 4,
) -> float:
    """What a rank holds at its peak beyond its model state, by the strategy's own rule (`Layout.transients`):
    whole-model and unit-sized buffers of weights (in the compute dtype) and of gradients (`grad_bytes` each: the
    dtype of the stored weights, 2 for DeepSpeed's 16-bit parameters, else fp32). Full gradients (ZeRO-1's backward,
    any accumulation over K > 1 micro-steps without a sync) replace the `grads_share` of the model the state already
    counts (1/G when gradients are sharded, 0 when replicated)."""
    mixed = precision in MIXED_PRECISIONS
    compute, t = (2 if mixed else 4), transients
    held = t.unit_weights * unit * compute + t.unit_grads * unit * grad_bytes
    held += t.model_grads * params * grad_bytes + (t.mixed_weight_copies * params * compute if mixed else 0.0)
    full = max(t.full_grads, t.full_grads_accumulating if accumulation > 1 else 0.0)
    return held + full * params * grad_bytes * (1 - grads_share)


def ring_allreduce_elements(params: float, world_size: int) -> float:
    """Elements each rank sends in a ring all-reduce: a reduce-scatter then an all-gather, (G-1)/G of the
    buffer each."""
    return ring_sent_elements(params, world_size, "all_reduce")


def comm_split(
    collectives: Iterable[Collective], world_size: int, mesh: Mesh, gpus: int | None = None
) -> tuple[float, float]:
    """Bytes each rank sends per optimizer step, summed over the strategy's declared collectives
    (`Strategy.collectives`): each one's times x the ring's share of its buffer (`ring_sent_elements`, over the ranks
    of its group) x its wire dtype's bytes. By link: (in rings within a node, in rings that cross nodes), for `gpus`
    ranks per node (None: one node). A ring over ranks of several nodes runs at the pace of its inter-node hop, which
    carries the ring's whole traffic: a ring over every rank crosses, so do shard groups with ranks on several nodes
    (plain FSDP, ZeRO over nodes x gpus ranks), while HSDP's shard groups (shard_size dividing gpus) stay in a node
    and only its all-reduce across the replicas crosses."""
    replicate, shard = mesh.groups(world_size, gpus)
    node = gpus or world_size
    tensor = mesh.tensor_size  # the mesh's last dimension: consecutive ranks, in a node unless tp_size > gpus
    ranks = {"world": world_size, "shard": shard, "replicate": replicate, "tensor": tensor}
    crosses = {
        "world": world_size > node,
        "shard": world_size > node and node % (shard * tensor) != 0,
        "replicate": world_size > node,
        "tensor": tensor > node,
    }
    within = across = 0.0
    for c in collectives:
        sent = c.times * ring_sent_elements(c.elements, ranks[c.group], c.kind) * WIRE_BYTES[c.dtype]
        if crosses[c.group]:
            across += sent
        else:
            within += sent
    return within, across


def comm_bytes(collectives: Iterable[Collective], world_size: int, mesh: Mesh, gpus: int | None = None) -> float:
    """Bytes each rank sends per optimizer step (`comm_split`, both links): the lesson's exercise 2 for a strategy
    that all-reduces bf16 gradients, twice that for one whose bf16 run reduces fp32 ones (DDP under autocast, FSDP's
    default reduce_dtype), as each declares."""
    return sum(comm_split(collectives, world_size, mesh, gpus))


def fsdp_step_bytes(params: float, ranks: int, micro_steps: int, wire_bytes: int) -> float:
    """Bytes a rank sends in a step of FSDP over `ranks` sharding `params`: each micro-step's parameters all-gathered
    twice (forward, backward) at the wire's width, the gradients reduce-scattered once in fp32, each a ring's
    (ranks - 1)/ranks of the whole."""
    return (ranks - 1) / ranks * params * (2 * micro_steps * wire_bytes + 4)


def tensor_rank_params(params: float, split: float, tensor_size: int) -> float:
    """The parameters one rank of a tensor-parallel group of `tensor_size` holds: 1/T of the `split` ones its plan
    splits (`ModelSize.tensor_split`), every other one whole (replicated over the group); `params` where T = 1."""
    return params - split + split / tensor_size if tensor_size > 1 else params


def strategy_comm(
    strategy: Any,
    params: float,
    precision: str,
    accumulation: int,
    world_size: int,
    gpus: int | None = None,
    gathered: float = 0,
    split: float = 0,
    reused: float = 0,
) -> tuple[float, float]:
    """`comm_split` of what `strategy` declares for this run over a model of `params` parameters, `split` of them split
    by its tensor-parallel plan (`ModelSize.tensor_split`; its collectives are over what a rank of a group holds),
    `reused` held by several modules (`ModelSize.reused`), with what its optimizer gathers (`gathered` elements
    updated whole: `launcher.optim.plan`)."""
    from launcher.optim.plan import optimizer_collectives

    held = tensor_rank_params(params, split, strategy.layout().mesh.tensor_size)
    found = [*strategy.collectives(held, precision, accumulation, world_size, gpus, reused)]
    found += optimizer_collectives(gathered, strategy.layout())
    return comm_split(found, world_size, strategy.layout().mesh, gpus)


def flops_per_token(params: int, n_layer: int = 0, n_embd: int = 0, seq_len: int = 0) -> float:
    """Model FLOPs to train on one token, forward and backward: 6 per parameter (2 in the forward matmul, 4 in
    backward's two) plus attention's scores and weighted values, 12 x layers x width x sequence (PaLM, appendix B;
    nanoGPT's estimate_mfu). A model without the GPT's sizes gets 6 x parameters only."""
    return 6 * params + 12 * n_layer * n_embd * seq_len


# Dense bf16/fp16 tensor-core peak per GPU, TFLOPS, from NVIDIA's datasheets (the "with sparsity" figures halved):
# H100/H200 SXM 989, H100 PCIe 756, A100 312, L40S 362, L4 121, A10 125, V100 125 (fp16). Matched in order, by
# substring of torch.cuda.get_device_name(): the PCIe H100 before the SXM one. MFU is measured against this
# figure whatever the run's precision (nanoGPT's convention); set trainer.peak_tflops for any other device.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The table's peak for a GPU name (e.g. "NVIDIA H100 80GB HBM3"), or None for a device it does not know."""
    return next((tflops for key, tflops in PEAK_TFLOPS if key in device_name), None)


def bound_gbps(link_gbps: float, internode_gbps: float, nodes: int) -> float:
    """A ring over several nodes moves at the pace of its slowest hop: the inter-node link."""
    return link_gbps if nodes == 1 else min(link_gbps, internode_gbps)


def split_comm_seconds(within: float, across: float, link_gbps: float, internode_gbps: float) -> float:
    """Time for a step's bytes by link (`comm_split`): within nodes at the node's link, across nodes at the
    slower of the two, one after the other (no overlap)."""
    return comm_seconds(within, link_gbps) + comm_seconds(across, min(link_gbps, internode_gbps))


def comm_seconds(nbytes: float, gbps: float) -> float:
    """Time to send `nbytes` at `gbps` GB/s (bandwidth only: no latency term, no overlap with compute)."""
    return nbytes / (gbps * GB)


def activation_bytes(
    seq: int,
    micro: int,
    hidden: int,
    heads: int,
    layers: int,
    vocab: int,
    elem: int,
    checkpointing: bool = False,
    tensor: int = 1,
    sequence: bool = False,
) -> float:
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
    Under tensor parallel over t ranks without sequence parallel (their section 4.1), what the split matmuls and the
    attention save is 1/t on each rank, the norms' and dropouts' inputs whole: s·b·h·(10 + 24/t + 5·a·s/(h·t)).
    With sequence parallel (`sequence`, their section 4.2.2) those are split on the sequence too: everything is 1/t,
    s·b·h·(34/t + 5·a·s/(h·t)), and a checkpointed block's input s·b·h/t.
    """
    s, b, h, a, L, V, t = seq, micro, hidden, heads, layers, vocab, tensor
    whole = 0 if sequence else 10
    per_layer = s * b * h * (whole + (34 - whole) / t + 5 * a * s / (h * t)) * elem / 2
    outside = 2 * s * b * h * elem + s * b * V * (elem + 4)
    if checkpointing:
        return L * s * b * h * elem / (t if sequence else 1) + per_layer + outside
    return L * per_layer + outside
