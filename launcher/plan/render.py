"""The plan for people and scripts: the table (`launch plan`), the JSON (`plan.format=json`), the chart
(`plan.chart=FILE.png`), and the one-line reasons `strategy=auto` prints."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from launcher.config import ConfigError
from launcher.plan.costs import GB, GPT_TARGET, KINDS, PLACES, BytesPerParam
from launcher.plan.fit import RANKING, Plan, StrategyPlan, what_would_fit
from strategies.declarations import Placement

WHERE = {"device": "device", "cpu": "host", "nvme": "nvme"}
"""Printed names of the places: host memory is Placement.where == "cpu"."""


UNITS = (("GB", GB), ("MB", 1e6), ("kB", 1e3))


def _unit(largest: float) -> tuple[str, float]:
    """The largest unit in which `largest` bytes reads as at least 1 (a tiny model's plan in MB, not 0.00 GB)."""
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def _size(nbytes: float) -> str:
    unit, size = _unit(nbytes)
    return f"{nbytes / size:.2f} {unit}"


def _placement(p: Placement, shards: str = "G") -> str:
    """`shards`: over how many ranks a sharded kind is split, G (every rank) or an HSDP shard group's size."""
    return (f"1/{shards}" if p.sharded else "full") + ("" if p.where == "device" else f" {WHERE[p.where]}")


def as_dict(plan: Plan) -> dict[str, Any]:
    """The plan for scripts (plan.format=json): bytes, seconds, counts."""
    d, pick = plan.derived, plan.pick()
    return {
        "model": {
            "target": plan.model_target,
            "params": plan.model.params,
            "largest_layer_params": plan.model.largest_layer,
            "reused": plan.model.reused,
        },
        "precision": plan.precision,
        "optimizer": {"target": plan.optimizer, "moments": plan.moments},
        "batch": {
            "micro": plan.micro,
            "accumulation": d.accumulation,
            "world_size": d.world_size,
            "gpus": d.gpus,
            "nodes": d.nodes,
            "global": plan.global_size,
        },
        "activations": {
            "seq_len": plan.seq_len,
            "bytes": plan.activations if plan.gpt else None,
            "checkpointed_bytes": plan.activations_checkpointed if plan.gpt else None,
        },
        "device_memory": {
            "bytes": plan.device.total,
            "usable_bytes": plan.device.usable,
            "headroom": plan.device.headroom,
            "source": plan.device.source,
        },
        "host_memory": {"bytes_per_node": plan.host.total, "source": plan.host.source},
        "nvme": {"bytes_per_node": plan.nvme.total, "source": plan.nvme.source},
        "link": {"gbps": plan.link_gbps, "internode_gbps": plan.internode_gbps, "bound_gbps": plan.gbps},
        "strategies": [
            {
                "name": sp.name,
                "layout": {
                    kind: {"sharded": p.sharded, "where": WHERE[p.where]}
                    for kind, p in (
                        ("params", sp.layout.params),
                        ("grads", sp.layout.grads),
                        ("optimizer", sp.layout.optimizer),
                    )
                },
                "bytes_per_param": {kind: getattr(sp.bpp, kind) for kind in KINDS},
                "state_bytes": {WHERE[place]: sp.held[place] for place in PLACES},
                "device_state_bytes": sp.on("device"),
                "host_state_bytes": sp.on("cpu"),
                "nvme_state_bytes": sp.on("nvme"),
                "gathered_bytes": sp.gathered,
                "transient_bytes": sp.transient,
                "export_host_bytes": sp.export,
                "activation_bytes": sp.activations,
                "peak_device_bytes": sp.peak_device,
                "peak_bytes": plan.peak(sp),  # where the device's memory is: with device=cpu, offloaded state too
                "need_bytes": plan.need(sp),  # what `fits` compares with the device's usable bytes
                "fits": plan.fits(sp),
                "host_need_bytes_per_node": plan.host_need(sp),
                "shortfalls": [
                    {"limit": s.limit, "need_bytes": s.need, "usable_bytes": s.usable, "per": s.per}
                    for s in plan.shortfalls(sp)
                ],
                "shards": sp.shards,
                "comm_bytes": sp.comm_bytes,
                "internode_bytes": sp.internode_bytes,
                "comm_seconds": sp.comm_seconds,
            }
            for sp in plan.strategies
        ],
        "auto": pick.name if pick else None,
        "auto_by": RANKING[plan.decided_by(pick)[0]][0] if pick else None,
    }


def _header(plan: Plan) -> list[str]:
    d, m = plan.derived, plan.model
    moments = f"{plan.moments} x fp32" if plan.moments else "none"
    rules: dict[BytesPerParam, list[str]] = {}
    for sp in plan.strategies or []:
        rules.setdefault(sp.bpp, []).append(sp.name)

    def rule(b: BytesPerParam) -> str:
        weights = f"weights {b.weights} ({plan.precision if b.weights == 2 else 'fp32'})"
        master = f" + master {b.master} (fp32)" if b.master else ""
        ema = f" + ema {b.ema} (fp32)" if b.ema else ""
        return f"{weights}{master} + grads {b.grads} (fp32) + moments {b.moments} ({moments}){ema} = {b.total}"

    optimizer = plan.optimizer.rsplit(".", 1)[-1]
    bpp = "; ".join(f"{rule(b)}: {', '.join(names)}" for b, names in rules.items())
    lines = [
        f"model        {plan.model_target}: {m.params:,} parameters (counted on the meta device), "
        f"largest layer {m.largest_layer:,}",
        f"bytes/param  {plan.precision} + {optimizer}: {bpp}",
        f"batch        micro {plan.micro} x accumulation {d.accumulation} x world {d.world_size} "
        f"({d.nodes} node(s) x {d.gpus} GPUs) = global {plan.global_size}",
    ]
    if plan.gpt:
        lines.append(
            f"activations  per rank, micro-batch {plan.micro} x seq {plan.seq_len}: {_size(plan.activations)}; "
            f"with activation checkpointing {_size(plan.activations_checkpointed)} (Korthikanti et al. 2022)"
        )
    else:
        lines.append(f"activations  not estimated: the formula is for the built-in GPT ({GPT_TARGET})")
    lines.append(
        f"device       {_size(plan.device.total)} ({plan.device.source}), headroom {plan.device.headroom:.0%}: "
        f"{_size(plan.device.usable)} usable"
    )
    if d.device == "cpu":
        lines.append("host         the device: what a rank offloads is counted on it")
    elif plan.host.total is None:
        lines.append(f"host         {plan.host.source}")
    else:
        lines.append(
            f"host         {_size(plan.host.total)} per node ({plan.host.source}), headroom "
            f"{plan.device.headroom:.0%}: {_size(plan.host.total * (1 - plan.device.headroom))} usable by its "
            f"{d.gpus} ranks"
        )
    if any(sp.on("nvme") for sp in plan.strategies):
        nvme = f"{_size(plan.nvme.total)} per node ({plan.nvme.source})" if plan.nvme.total else plan.nvme.source
        lines.append(f"nvme         {nvme}")
    link = f"{plan.link_gbps:g} GB/s per GPU within a node"
    if d.nodes > 1:
        link += f", {plan.internode_gbps:g} GB/s between nodes: rings across nodes run at {plan.gbps:g} GB/s"
    lines.append(f"link         {link}")
    return lines


def _table(groups: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell (first left-aligned, others right), under group titles spanning them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    spans, column = [], 0
    for title, n in groups:  # widen a group's last column until its title fits over it
        span = sum(widths[column : column + n]) + 2 * (n - 1)
        widths[column + n - 1] += max(0, len(title) - span)
        spans.append(title.center(sum(widths[column : column + n]) + 2 * (n - 1)))
        column += n
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]
    return ["  ".join(spans).rstrip(), *lines]


def strategy_rows(plan: Plan, blocked: Collection[str] = (), compact: bool = False) -> list[str]:
    """One line per strategy, side by side: its layout, model state per rank by kind (`host`/`nvme`: offloaded
    there) and by place, peak device memory, communication per step; * marks auto's pick. `compact`: only
    what auto decides on."""
    pick = plan.pick(blocked)
    unit, size = _unit(max(max(plan.peak(sp), sp.on("cpu"), sp.on("nvme"), sp.comm_bytes) for sp in plan.strategies))

    def amount(nbytes: float) -> str:
        return f"{nbytes / size:.2f}"

    across = plan.derived.nodes > 1  # a column for what crosses nodes
    rows, groups = [], []
    for sp in plan.strategies:
        fits = "yes" if plan.fits(sp) else "no"
        if sp.name in blocked:
            fits += " (refused)"
        name = ("* " if sp is pick else "  ") + sp.name
        comm = [
            amount(sp.comm_bytes),
            *([amount(sp.internode_bytes)] if across else []),
            f"{sp.comm_seconds * 1e3:.3g}",
        ]
        if compact:
            rows.append([name, amount(plan.peak(sp)), fits, *comm])
            continue
        where = {
            "weights": sp.layout.params.where,
            "master": sp.layout.optimizer.where,
            "grads": sp.layout.grads.where,
            "moments": sp.layout.optimizer.where,
            "ema": sp.layout.params.where,
        }
        kinds = [amount(sp.held[where[k]][k]) + ("" if where[k] == "device" else f" {WHERE[where[k]]}") for k in KINDS]
        shards = "G" if sp.shards == plan.derived.world_size else str(sp.shards)
        rows.append(
            [
                name,
                _placement(sp.layout.params, shards),
                _placement(sp.layout.grads, shards),
                _placement(sp.layout.optimizer, shards),
                *kinds,
                amount(sp.on("device")),
                amount(sp.on("cpu")),
                amount(sp.on("nvme")),
                amount(sp.transient),
                amount(plan.peak(sp)),
                fits,
                *comm,
            ]
        )
    if compact:
        groups = [("", 1), (f"per device, {unit}", 2), ("comm per step", 2 + across)]
        header = ["strategy", "peak", "fits", unit, *(["nodes"] if across else []), "ms"]
    else:
        groups = [
            ("", 1),
            ("layout", 3),
            (f"model state by kind, {unit}", len(KINDS)),
            (f"state by place, {unit}", 3),
            (f"peak per device, {unit}", 3),
            ("comm per step", 2 + across),
        ]
        header = [
            "strategy",
            "params",
            "grads",
            "optimizer",
            *KINDS,
            "device",
            "host",
            "nvme",
            "transient",
            "peak",
            "fits",
            unit,
            *(["nodes"] if across else []),
            "ms",
        ]
    why = _why_not(plan)
    return [*_table(groups, [header, *rows]), *([] if compact or not why else [""]), *why]


def _why_not(plan: Plan) -> list[str]:
    """One line per strategy that does not fit: each limit it exceeds, and by how much."""
    lines = []
    width = max(len(sp.name) for sp in plan.strategies)
    for sp in plan.strategies:
        if short := plan.shortfalls(sp):
            why = "; ".join(
                f"{s.limit}: needs {_size(s.need)} {s.per}, {_size(s.usable)} usable, {_size(s.over)} over"
                for s in short
            )
            lines.append(f"  {sp.name + ':':<{width + 1}} {why}")
    return ["does not fit:", *lines] if lines else []


def _comm(plan: Plan, sp: StrategyPlan) -> str:
    across = f", {_size(sp.internode_bytes)} of it across nodes" if plan.derived.nodes > 1 else ""
    return f"{sp.comm_seconds * 1e3:.3g} ms per step ({_size(sp.comm_bytes)} per rank{across})"


def describe_pick(plan: Plan, blocked: dict[str, str] | None = None) -> str:
    """Why auto picks what it picks, or, when nothing fits, what would."""
    blocked = blocked or {}
    pick = plan.pick(blocked)
    if pick is None:
        runnable = [sp for sp in plan.strategies if sp.name not in blocked] or plan.strategies
        smallest = min(runnable, key=plan.need)
        would = what_would_fit(plan, blocked)
        runs = "runnable strategy" if blocked else "strategy"
        short = [s for s in plan.shortfalls(smallest) if s.limit != "device memory"]  # the node's limits, beyond it
        beyond = [f"{_size(s.over)} over the {s.limit} {s.per}" for s in short]
        return (
            f"no {runs} fits {_size(plan.device.usable)} per device (the least any needs, {smallest.name}'s, is "
            f"{_size(plan.need(smallest))}{''.join(f'; it is {b}' for b in beyond)}); would fit: "
            f"{'; '.join(would) or 'nothing found: shrink the model or data.seq_len'}"
        )
    measure, after = plan.decided_by(pick, blocked)
    line = f"{pick.name}: {RANKING[0][1]} of those that fit, {_comm(plan, pick)}"
    if after is not None and measure == 0:
        line += f"; next {after.name}, {_comm(plan, after)}"
    elif after is not None:
        tied = ", ".join(name for name, _, _ in RANKING[:measure])
        line += f"; tied with {after.name} on {tied}, picked by {RANKING[measure][1]}"
    return f"{line}; its peak {_size(plan.peak(pick))} fits {_size(plan.device.usable)} per device"


def render(plan: Plan) -> str:
    notes = [
        "per rank; GB = 1e9 bytes, MB = 1e6. layout: what each strategy's layout() shards (1/G) or keeps whole, "
        "and offloads"
        " (host, nvme).",
        "peak = model state on the device + transient (each strategy's own buffers: autocast's weight copies,"
        " gathered units, ZeRO-1's full gradients in backward, whole gradients while accumulating, DeepSpeed's"
        " buckets) + activations (without checkpointing); on device=cpu also what"
        " is offloaded to the host.",
        f"comm: bytes each rank sends per optimizer step, the sum of the collectives each strategy declares, in the"
        f" dtype it sends (ring all-reduce 2(G-1)/G x P; sharded parameters add an all-gather in each forward and"
        f" backward; hsdp: the same in its shard group of S ranks, G = S, plus an all-reduce of each rank's 1/S"
        f" shard across the R replicas, 2(R-1)/R x P/S);"
        f" ms at {plan.link_gbps:g} GB/s within a node"
        + (
            f", {plan.gbps:g} GB/s for rings that cross nodes. nodes: of those bytes, what such rings carry (a ring"
            " over ranks of several nodes carries all its traffic over the inter-node link: fsdp's and zero's over"
            " every rank; hsdp's shard rings stay in a node, only its all-reduce across nodes crosses)."
            if plan.derived.nodes > 1
            else "."
        ),
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
    colors = dict(zip([*KINDS, "transient", "activations"], plt.get_cmap("tab10").colors))
    device_layers = [(kind, [sp.held["device"][kind] for sp in plan.strategies], colors[kind], None) for kind in KINDS]
    device_layers += [
        ("transient", [sp.transient for sp in plan.strategies], colors["transient"], None),
        ("activations", [sp.activations for sp in plan.strategies], colors["activations"], None),
    ]
    offloaded_layers = [
        (f"{kind} ({WHERE[place]})", [sp.held[place][kind] for sp in plan.strategies], colors[kind], hatch)
        for place, hatch in (("cpu", None), ("nvme", "//"))
        for kind in KINDS
    ]

    fig, (device, offloaded) = plt.subplots(1, 2, figsize=(max(10, 1.5 * len(names) + 4), 5.5), width_ratios=[3, 2])
    for ax, layers, title in (
        (device, device_layers, "on the device, per rank"),
        (offloaded, offloaded_layers, "offloaded, per rank (hatched: NVMe)"),
    ):
        bottom = [0.0] * len(names)
        for label, values, color, hatch in layers:
            if any(values):
                gb = [v / GB for v in values]
                ax.bar(names, gb, bottom=bottom, label=label, color=color, hatch=hatch, edgecolor="white")
                bottom = [b + v for b, v in zip(bottom, gb)]
        for i, total in enumerate(bottom):  # the figure a reader compares (with the usable line, on the left)
            if total:
                ax.annotate(
                    f"{total:.1f}", (i, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8
                )
        ax.set_ylim(0, 1.15 * max(*bottom, plan.device.usable / GB if ax is device else 0, 1e-9))
        ax.set_title(title)
        ax.set_ylabel("GB")
        ax.tick_params(axis="x", rotation=30)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    usable = plan.device.usable / GB
    device.axhline(usable, color="black", linestyle="--", linewidth=1)
    device.annotate(
        f"usable per device: {usable:.1f} GB",
        (len(names) - 0.5, usable),
        xytext=(0, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
    )
    d = plan.derived
    fig.suptitle(
        f"{plan.model.params / 1e9:.2f} B parameters, {plan.precision}, {plan.optimizer.rsplit('.', 1)[-1]}, "
        f"world size {d.world_size}, micro-batch {plan.micro} x seq {plan.seq_len}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
