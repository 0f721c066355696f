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

from launcher.plan.costs import GB, MIXED_PRECISIONS, activation_bytes, bytes_per_param, comm_seconds
from launcher.plan.fit import Plan
from strategies.comm import ring_sent_elements
from strategies.declarations import WIRE_BYTES

SIZES = (1, 2, 4, 8)


def split_params(model: Any, resolved: dict[str, str]) -> int:
    """Parameters a plan splits over the group (each counted once): the weights of the modules it names, and the
    biases of the colwise ones (a rowwise layer's bias is added once, whole)."""
    from strategies.tp_plans import weight_dim

    modules, seen, split = dict(model.named_modules()), set(), 0
    for name, style in resolved.items():
        dim = weight_dim(style, modules[name])
        for pname, p in modules[name].named_parameters(recurse=False):
            if dim is not None and id(p) not in seen and (pname == "weight" or dim == 0):
                seen.add(id(p))
                split += p.numel()
    return split


def tensor_lines(plan: Plan, model: Any, cfg: Any) -> list[str]:
    """The section's lines; none for a model without a tensor-parallel plan."""
    from strategies.tp_plans import SEQUENCE, model_plan, resolve, tp_collectives

    resolved = resolve(model, model_plan(model))
    if not any(style != "replicate" for style in resolved.values()):
        return []
    d, P = plan.derived, plan.model.params
    world, gpus = d.world_size, d.gpus
    split = split_params(model, resolved)
    sequence = any(style in SEQUENCE for style in resolved.values())  # the norms' activations split too
    elem = 2 if plan.precision in MIXED_PRECISIONS else 4
    dtype = plan.precision if plan.precision in MIXED_PRECISIONS else "fp32"
    bpp = bytes_per_param(plan.precision, plan.moments, False, False, plan.ema).total
    m = cfg.model
    rows = []
    for t in (t for t in SIZES if world % t == 0):
        data = world // t
        accumulation, rest = divmod(plan.global_size, plan.micro * data)
        if rest or not accumulation:
            continue
        held = (split / t + P - split) / data  # parameters per rank
        unit = (plan.model.largest_unit or P) / t
        shape = (plan.seq_len, plan.micro, m.n_embd, m.n_head, m.n_layer, m.vocab_size, elem) if plan.gpt else ()
        acts = activation_bytes(*shape, tensor=t, sequence=sequence) if plan.gpt else 0.0
        kept = activation_bytes(*shape, checkpointing=True, tensor=t, sequence=sequence) if plan.gpt else 0.0
        collectives = tp_collectives(model, model_plan(model), plan.micro * plan.seq_len, accumulation, dtype)
        tp = sum(c.times * ring_sent_elements(c.elements, t, c.kind) * WIRE_BYTES[c.dtype] for c in collectives)
        gathers = 2 * accumulation * (data - 1) / data * held * data * WIRE_BYTES[dtype]  # all-gathered, resharded
        fsdp = gathers + (data - 1) / data * held * data * 4  # + the fp32 reduce-scatter
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
