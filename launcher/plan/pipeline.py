"""`launch plan`'s pipeline section: per pipeline rank, the same job at P = 1, 2, 4 and 8 stages' ranks under FSDP2
(strategy=fsdp with strategy.pp_size=P), for each of torch's schedules: the model state of the rank's stages, the
activations it keeps, the bubble, and the activations (and their gradients) it sends to other stages.

The formulas (docs/planning.md):
- P pipeline ranks (P x T with tensor parallel in each stage, strategy.tp_size=T) read the same micro-batches, so the
  data-parallel ranks are D = G/(P x T) and the schedule's micro-batches are the accumulation's, M = global / (micro x
  D). FSDP shards each rank's stages over its D ranks; the parameters the tensor-parallel plan splits count 1/T, and
  the activations and the hidden states sent are those of a rank's part under a sequence-parallel plan.
- The split is the one the run makes (`strategies.pipeline_layout.plan_split`, by `strategy.pp_balance`); a stage
  holds its layers, the first also the modules before the layer list (embeddings), the last those after it (final
  norm, head), a parameter tied across stages on each stage that uses it.
- The bubble, the share of a step a rank waits, with a micro-batch's forward and backward at one stage taken as 3
  equal parts (forward, the inputs' gradients, the weights'): (P-1)/(M+P-1) for gpipe and 1f1b; (P-1)/(vM+P-1) for
  interleaved_1f1b with v stages per rank (Narayanan et al. 2021); zero-bubble schedules, whose weight gradients fill
  the waits, (P-1)/(3vM+P-1) (Qi et al. 2024, ZB-H1's third of 1F1B's bubble; zbv: v = 2), an upper bound.
- The bytes sent between stages, per rank: each micro-batch's hidden state (micro x seq x width at the activations'
  dtype) forward over every stage boundary whose next stage is on another rank, and its gradient back over every
  boundary whose previous one is: what the run's counter measures as `pp_sent_bytes` (the largest rank's).
- The activations kept: those of the rank's layers for the micro-batches in flight, M under gpipe, min(M, P) under the
  others (1F1B's bound), each as `launcher.plan.costs.activation_bytes` counts a layer of the built-in GPT (other
  models: not known, not counted).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from omegaconf import OmegaConf

from launcher.plan.costs import GB, MIXED_PRECISIONS, activation_bytes, bytes_per_param
from launcher.plan.fit import Plan

SIZES = (1, 2, 4, 8)


def bubble(schedule: str, P: int, M: int, per_rank: int = 2) -> float:
    """The share of a step a pipeline rank waits (module docstring)."""
    if P == 1:
        return 0.0
    v = 2 if schedule == "zbv" else per_rank if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") else 1
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if schedule == "interleaved_1f1b":
        return (P - 1) / (v * M + P - 1)
    return (P - 1) / (3 * v * M + P - 1)


def boundary_sends(schedule: str, P: int, per_rank: int, rank: int) -> int:
    """The stage boundaries pipeline rank `rank` sends over per micro-batch: forward to a next stage on another rank,
    and backward to a previous one on another rank."""
    from strategies.pipeline_layout import held_stages, stage_count

    stages = stage_count(schedule, P, per_rank)
    holder = {i: r for r in range(P) for i in held_stages(schedule, P, per_rank, r)}
    mine = held_stages(schedule, P, per_rank, rank)
    forward = sum(1 for i in mine if i < stages - 1 and holder[i + 1] != rank)
    backward = sum(1 for i in mine if i > 0 and holder[i - 1] != rank)
    return forward + backward


def stage_bytes_sent(schedule: str, P: int, per_rank: int, M: int, hidden_bytes: float) -> float:
    """The most bytes a pipeline rank sends to other stages' ranks per optimizer step: M micro-batches' hidden states
    (`hidden_bytes` each) over each boundary it sends over (`boundary_sends`)."""
    if P == 1:
        return 0.0
    return M * hidden_bytes * max(boundary_sends(schedule, P, per_rank, r) for r in range(P))


def width(model: Any, cfg: Any) -> int | None:
    """The hidden state's width between two stages: the built-in GPT's n_embd, a transformers model's hidden_size;
    None where the plan cannot tell."""
    if "n_embd" in cfg.model:
        return int(cfg.model.n_embd)
    found = getattr(getattr(model, "config", None), "hidden_size", None)
    return int(found) if isinstance(found, int) else None


def _stage_params(model: Any, split: Any, divided: Collection[int] = (), T: int = 1) -> list[float]:
    """Each stage's parameters: its layers, and the modules outside the list on the first and the last stage (a tied
    parameter counted on each stage that holds it, once there); those in `divided` (a tensor-parallel plan's) 1/T."""
    layers = model.get_submodule(split.path)
    found = []
    for index, (lo, hi) in enumerate(split.ranges):
        held = {id(p): p for i in range(lo, hi) for p in layers[i].parameters()}
        for name, role in split.roles.items():
            if (role == "pre" and index == 0) or (role == "post" and index == len(split.ranges) - 1):
                held |= {id(p): p for p in model.get_submodule(name).parameters(recurse=False)}
        found.append(sum(p.numel() / (T if key in divided else 1) for key, p in held.items()))
    return found


def pipeline_lines(plan: Plan, model: Any, cfg: Any) -> list[str]:
    """The section's lines; none for a model without a layer list the launcher can split."""
    from strategies.pipeline_layout import (
        SCHEDULES,
        held_stages,
        layer_list,
        microbatch_problem,
        plan_split,
        stage_count,
    )

    if layer_list(model) is None:
        return []
    d = plan.derived
    world, per_rank = d.world_size, 2
    T, divided, sequence = _tensor_parallel(model, cfg)
    balance = str(cfg.strategy.get("pp_balance", "layers")) if "strategy" in cfg else "layers"
    bpp = bytes_per_param(plan.precision, plan.moments, False, False, plan.ema).total
    elem = 2 if plan.precision in MIXED_PRECISIONS else 4
    hidden = width(model, cfg)
    # Under a sequence-parallel plan a stage sends the next its rank's part of the sequence.
    hidden_bytes = plan.micro * plan.seq_len * hidden * elem / (T if sequence else 1) if hidden else None
    gpt = cfg.model if plan.gpt else None
    rows = []
    for P in (p for p in SIZES if world % (p * T) == 0):
        data = world // (P * T)
        M, rest = divmod(plan.global_size, plan.micro * data)
        if rest or not M:
            continue
        for schedule in SCHEDULES if P > 1 else ("none",):
            name = "fsdp" if P == 1 else schedule
            try:
                stages = 1 if P == 1 else stage_count(schedule, P, per_rank)
                split = plan_split(model, stages, None, balance, P, schedule if P > 1 else "1f1b")
            except ValueError:
                rows.append(f"  {P:>2}  {name:<24} {data:>5} {M:>4}  (more stages than layers)")
                continue
            if P > 1 and (why := microbatch_problem(schedule, P, M)):
                rows.append(f"  {P:>2}  {name:<24} {data:>5} {M:>4}  refused: {why}")
                continue
            params = _stage_params(model, split, divided, T)
            ranks = [held_stages(schedule, P, per_rank, r) if P > 1 else [0] for r in range(P)]
            state = max(sum(params[i] for i in mine) for mine in ranks) * bpp / data
            acts = 0.0
            if gpt is not None:
                layers = max(sum(split.ranges[i][1] - split.ranges[i][0] for i in mine) for mine in ranks)
                in_flight = M if schedule == "gpipe" else min(M, P)
                shape = (plan.seq_len, plan.micro, gpt.n_embd, gpt.n_head, layers, gpt.vocab_size, elem)
                acts = in_flight * activation_bytes(*shape, tensor=T, sequence=sequence)
            peak = state + acts
            sent = (
                "?" if hidden_bytes is None else f"{stage_bytes_sent(schedule, P, per_rank, M, hidden_bytes) / 1e6:.2f}"
            )
            rows.append(
                f"  {P:>2}  {name:<24} {data:>5} {M:>4} {state / GB:>9.2f} {acts / GB:>8.2f} {peak / GB:>8.2f} "
                f"{'yes' if peak <= plan.device.usable else 'no':>4} {bubble(schedule, P, M, per_rank):>7.1%} "
                f"{sent:>9}"
            )
    tensor = f" strategy.tp_size={T}" if T > 1 else ""
    ranks = "P x T ranks" if T > 1 else "P ranks"
    return [
        "",
        f"pipeline parallel (strategy=fsdp strategy.pp_size=P strategy.pp_schedule=S{tensor}; looped schedules at 2 "
        "stages per rank)",
        "   P  schedule                  data    M  state GB  acts GB  peak GB  fits  bubble   sent MB",
        *rows,
        f"per pipeline rank, per optimizer step, its largest: {ranks} hold the stages and read the same micro-batches "
        f"(data = G/{'(P x T)' if T > 1 else 'P'}, M = the accumulation); bubble: the share of the step it waits; "
        "sent MB: the hidden states and their gradients it sends to other stages' ranks (docs/planning.md)",
    ]


def _tensor_parallel(model: Any, cfg: Any) -> tuple[int, set[int], bool]:
    """The run's tensor parallel within each stage: (T, the ids of the parameters its plan splits, whether the plan
    splits the sequence); (1, none, False) without it."""
    from launcher.models.meta import run_plan
    from strategies.tp_plans import SEQUENCE, resolve, split_tensors

    T = int(OmegaConf.select(cfg, "strategy.tp_size", default=1) or 1)
    if T == 1:
        return 1, set(), False
    resolved = resolve(model, run_plan(model, cfg))
    return T, split_tensors(model, resolved), any(style in SEQUENCE for style in resolved.values())


def step_seconds(model: Any, cfg: Any, world: int, gpus: int, peak_flops: float) -> tuple[float, float, float, float]:
    """(a step's seconds under the run's pipeline, under FSDP over every rank at the same tensor parallel, the
    pipeline's bubble, the bytes a pipeline rank sends to other stages) by the plan's figures, for a pipeline whose
    stages are on different nodes. Each is compute at the device's peak (6 FLOPs per parameter and token of a
    rank's share), stretched by the bubble under the pipeline, plus FSDP's gathers and reduce-scatters
    (`fsdp_step_bytes`: over a stage's D ranks, within a node where D x T fits one; over all G/T ranks across nodes
    without the pipeline) and the hidden states sent between stages across nodes, one after another (no overlap).
    Compute at the peak is the least it can take: the bubble's cost is a lower bound, the pipeline's case its best."""
    from launcher.plan.costs import comm_seconds, fsdp_step_bytes
    from strategies.declarations import WIRE_BYTES
    from strategies.pipeline_layout import held_stages, plan_split, stage_count

    s, precision = cfg.strategy, str(cfg.precision)
    P, schedule, per_rank = int(s.pp_size), str(s.pp_schedule), int(s.get("pp_stages_per_rank") or 2)
    T, divided, sequence = _tensor_parallel(model, cfg)
    micro, global_size = int(cfg.batch.micro_size), int(cfg.batch.global_size)
    seq = int(OmegaConf.select(cfg, "data.seq_len", default=None) or OmegaConf.select(cfg, "model.block_size"))
    elem = 2 if precision in MIXED_PRECISIONS else 4
    wire = WIRE_BYTES[precision if precision in MIXED_PRECISIONS else "fp32"]
    link, across = float(cfg.plan.link_gbps), min(float(cfg.plan.link_gbps), float(cfg.plan.internode_gbps))
    D, R = world // (P * T), world // T  # a stage's data-parallel ranks; FSDP's over every rank without the pipeline
    M, K = global_size // (micro * D), global_size // (micro * R)
    split = plan_split(model, stage_count(schedule, P, per_rank), s.get("pp_split"), str(s.pp_balance), P, schedule)
    params = _stage_params(model, split, divided, T)
    stage = max(sum(params[i] for i in held_stages(schedule, P, per_rank, r)) for r in range(P))
    whole = sum(p.numel() / (T if id(p) in divided else 1) for p in model.parameters())
    hidden = width(model, cfg)
    sent = stage_bytes_sent(
        schedule, P, per_rank, M, micro * seq * hidden * elem / (T if sequence else 1) if hidden else 0
    )
    b = bubble(schedule, P, M, per_rank)
    gathers = fsdp_step_bytes(stage, D, M, wire)
    pipelined = (
        6 * stage * M * micro * seq / peak_flops / (1 - b)
        + comm_seconds(gathers, link if D * T <= gpus else across)
        + comm_seconds(sent, across)
    )
    flat = 6 * whole * K * micro * seq / peak_flops + comm_seconds(fsdp_step_bytes(whole, R, K, wire), across)
    return pipelined, flat, b, sent


def check_pipeline_nodes(cfg: Any, derived: Any, model: Any) -> None:
    """A pipeline whose stages are on different nodes, weighed by the plan against FSDP over every rank (what it
    saves: FSDP's gathers on the network; what it costs: its bubble and the hidden states it sends): ConfigError (one
    line) where it costs more, unless strategy.pp_across_nodes says the user accepts it; one line where it is run."""
    from launcher.config import ConfigError
    from launcher.plan.costs import peak_tflops

    P = int(OmegaConf.select(cfg, "strategy.pp_size", default=1) or 1)
    if P == 1 or derived.nodes == 1 or OmegaConf.select(cfg, "strategy.pp_across_nodes", default=False):
        return
    tflops = OmegaConf.select(cfg, "trainer.peak_tflops", default=None)
    if tflops is None and derived.device == "cuda":
        import torch

        tflops = peak_tflops(torch.cuda.get_device_name(0))
    if tflops is None:
        print(
            f"launch: pipeline across {derived.nodes} nodes: not weighed against FSDP over every rank (the plan needs "
            "the device's peak: set trainer.peak_tflops)",
            flush=True,
        )
        return
    pipelined, flat, b, sent = step_seconds(model, cfg, derived.world_size, derived.gpus, float(tflops) * 1e12)
    said = (
        f"the plan puts a step at {pipelined * 1e3:.3g} ms (a {b:.0%} bubble, {sent / 1e6:.3g} MB of hidden states "
        f"sent between nodes), FSDP over all {derived.world_size} ranks at {flat * 1e3:.3g} ms"
    )
    if pipelined > flat:
        raise ConfigError(
            f"strategy.pp_size={P} across {derived.nodes} nodes costs more than it saves: {said} (at "
            f"{float(tflops):g} TFLOPS, plan.internode_gbps={cfg.plan.internode_gbps:g}); use strategy.pp_size=1, "
            "more micro-batches (a larger batch.global_size or a smaller batch.micro_size), or "
            "strategy.pp_across_nodes=true to run it anyway"
        )
    print(f"launch: pipeline across {derived.nodes} nodes: {said}", flush=True)
