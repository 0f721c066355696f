"""`launch plan`'s tensor-parallel section: per rank, the same job at T = 1, 2, 4 and 8 under FSDP2 (strategy=fsdp
with strategy.tp_size=T), beside plain FSDP (T = 1): the model state, the layer FSDP gathers, the activations, and
what each dimension sends per optimizer step.

The formulas (docs/planning.md): a tensor-parallel group of T ranks reads one micro-batch, so the data-parallel
ranks are D = G/T and the accumulation is global / (micro x D). The plan splits Ps parameters 1/T and keeps Pw
whole; FSDP shards what a rank holds over D: (Ps/T + Pw)/D parameters' state each. The activations' collectives are
the plan's own (`strategies.tp_plans.tp_collectives`: per layer of the built-in GPT, sequence parallel, 2 all-gathers
and 2 reduce-scatters in the forward and as many in the backward of micro x seq x hidden values), an all-reduce
sending 2(T-1)/T of its buffer in a ring, an all-gather or a reduce-scatter (T-1)/T.
"""

from __future__ import annotations

from typing import Any

from launcher.models.meta import run_plan
from launcher.plan.costs import (
    GB,
    MIXED_PRECISIONS,
    activation_bytes,
    bytes_per_param,
    comm_seconds,
    fsdp_step_bytes,
    tensor_rank_params,
)
from launcher.plan.fit import Plan
from strategies.comm import ring_sent_elements
from strategies.declarations import WIRE_BYTES

SIZES = (1, 2, 4, 8)


def tensor_lines(plan: Plan, model: Any, cfg: Any) -> list[str]:
    """The section's lines; none for a model without a tensor-parallel plan."""
    from strategies.tp_plans import SEQUENCE, resolve

    planned = run_plan(model, cfg)
    resolved = resolve(model, planned)
    if not any(style != "replicate" for style in resolved.values()):
        return []
    d, P = plan.derived, plan.model.params
    world, gpus = d.world_size, d.gpus
    split = plan.model.tensor_split
    sequence = any(style in SEQUENCE for style in resolved.values())  # the norms' activations split too
    elem = 2 if plan.precision in MIXED_PRECISIONS else 4
    dtype = plan.precision if plan.precision in MIXED_PRECISIONS else "fp32"
    bpp = bytes_per_param(plan.precision, plan.moments, False, False, plan.ema).total
    rows = []
    for t in (t for t in SIZES if world % t == 0):
        data = world // t
        accumulation, rest = divmod(plan.global_size, plan.micro * data)
        if rest or not accumulation:
            continue
        held = tensor_rank_params(P, split, t) / data  # parameters per rank
        unit = (plan.model.largest_unit or P) / t
        acts, kept = tensor_activations(plan, cfg, t, sequence, plan.micro)
        tp = tensor_traffic(plan, model, planned, t, accumulation, plan.micro)
        fsdp = fsdp_step_bytes(held * data, data, accumulation, WIRE_BYTES[dtype])  # gathered, resharded, reduced
        accumulating = held * data * 4 * (1 - 1 / data) if accumulation > 1 else 0.0  # FSDP's whole gradients, K > 1
        peak = held * bpp + 2 * unit * elem + 2 * unit * 4 + accumulating + acts
        recomputed = peak - acts + kept
        note = "  spans nodes" if t > gpus else ""
        rows.append(
            f"  {t:>2} {data:>5} {accumulation:>5} {held * bpp / GB:>9.2f} {acts / GB:>8.2f} {peak / GB:>8.2f} "
            f"{'yes' if peak <= plan.device.usable else 'no':>4} {recomputed / GB:>9.2f} "
            f"{'yes' if recomputed <= plan.device.usable else 'no':>4} {fsdp / GB:>8.2f} {tp / GB:>8.2f} "
            f"{comm_seconds(tp, plan.link_gbps) * 1e3:>8.1f}{note}"
        )
    split_share = f"{len(resolved)} modules planned, {split / P:.2%} of the parameters split"
    head = f"tensor parallel (strategy=fsdp strategy.tp_size=T: {split_share})"
    return [
        "",
        head,
        "   T  data  accum  state GB  acts GB  peak GB  fits  ckpt peak  fits  fsdp GB    tp GB    tp ms",
        *rows,
        f"per rank, per optimizer step: T ranks split each planned layer and read one micro-batch (data = G/T); "
        "ckpt peak: with strategy.activation_checkpointing=true; "
        "tp GB: the activations' all-reduces, all-gathers and reduce-scatters, "
        f"ms at {plan.link_gbps:.0f} GB/s within a node (docs/planning.md)",
    ]


def tensor_activations(plan: Plan, cfg: Any, t: int, sequence: bool, micro: int) -> tuple[float, float]:
    """(activations, with checkpointing) per rank of the built-in GPT under tensor parallel over `t` (0 for another
    model: the plan does not know its activations)."""
    if not plan.gpt:
        return 0.0, 0.0
    m = cfg.model
    elem = 2 if plan.precision in MIXED_PRECISIONS else 4
    shape = (plan.seq_len, micro, m.n_embd, m.n_head, m.n_layer, m.vocab_size, elem)
    return (
        activation_bytes(*shape, tensor=t, sequence=sequence),
        activation_bytes(*shape, checkpointing=True, tensor=t, sequence=sequence),
    )


def tensor_traffic(plan: Plan, model: Any, planned: dict[str, str], t: int, accumulation: int, micro: int) -> float:
    """Bytes a rank sends per optimizer step for the activations' collectives of the run's plan over `t` ranks."""
    from strategies.tp_plans import tp_collectives

    dtype = plan.precision if plan.precision in MIXED_PRECISIONS else "fp32"
    collectives = tp_collectives(model, planned, micro * plan.seq_len, accumulation, dtype)
    return sum(c.times * ring_sent_elements(c.elements, t, c.kind) * WIRE_BYTES[c.dtype] for c in collectives)


def with_tensor(plan: Plan, model: Any, cfg: Any) -> Plan:
    """The plan with each tensor-parallel strategy's activations split over its groups and their traffic in its comm
    figures (within a node; across nodes where a group spans them): what `make_plan`, which sees the model's sizes
    alone, leaves out."""
    from dataclasses import replace

    from launcher.plan.costs import split_comm_seconds
    from strategies.tp_plans import SEQUENCE, resolve

    planned = run_plan(model, cfg)
    resolved = resolve(model, planned)
    sequence = any(style in SEQUENCE for style in resolved.values())
    found = []
    for sp in plan.strategies:
        t = sp.layout.mesh.tensor_size
        if t == 1 or not resolved:
            found.append(sp)
            continue
        accumulation = max(plan.global_size // (plan.micro * plan.derived.world_size // t), 1)
        acts, _ = tensor_activations(plan, cfg, t, sequence, plan.micro)
        tp = tensor_traffic(plan, model, planned, t, accumulation, plan.micro)
        across = sp.internode_bytes + (tp if t > plan.derived.gpus else 0.0)
        within = sp.comm_bytes - sp.internode_bytes + (0.0 if t > plan.derived.gpus else tp)
        seconds = split_comm_seconds(within, across, plan.link_gbps, plan.internode_gbps)
        activations = acts if plan.gpt else sp.activations
        found.append(
            replace(
                sp, activations=activations, comm_bytes=within + across, comm_seconds=seconds, internode_bytes=across
            )
        )
    return replace(plan, strategies=found)
