"""Every strategy on the same tiny job, one table: `python bench/run.py [--steps 12] [--json out.json]`.

Each strategy in conf/strategy/ (but `auto`, which only picks one of them) runs through the real
`launch` console script: the tiny GPT on random tokens, sequence 64, micro-batch 2, global batch 16
(2 ranks x 4 micro-steps), logger=none, on 2 CPU ranks by default (`--device cuda --gpus N` on GPUs).
Figures are rank maxima from metrics.jsonl: step time and tokens/s over the last logged window (the
first steps, with lazy initialisation, left out), model-state bytes per rank, peak memory per rank
(live bytes at the dispatch level on CPU, max allocated on CUDA) next to the planner's peak,
communication per optimizer step: measured (ring bytes this rank sent in the gradient-sync collectives
the strategy counted) next to the planner's formula, and MFU where the device's peak is known (or
`--peak-tflops`). Then the launcher-vs-plain-torchrun overhead, from bench/overhead.py's own runs.
`--recipe [STRATEGY ...]` instead: the step time of EMA weights and of Muon against AdamW (ddp and fsdp by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from overhead import TINY_JOB, compare, report  # noqa: E402  (bench/ is scripts, not a package)

LAUNCH = str(Path(sys.executable).parent / "launch")
JOB = [*TINY_JOB, "data.seq_len=64", "batch.global_size=16", "batch.micro_size=2", "trainer.warmup_steps=2"]
COLUMNS = (
    "strategy",
    "world size",
    "step time (s)",
    "tokens/s",
    "model state / rank",
    "peak memory / rank",
    "planned peak",
    "planned / measured",
    "comm payload / step",
    "comm sent / step measured",
    "comm sent / step formula",
    "measured / formula",
    "MFU",
)


def strategies() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml") if p.stem != "auto")


def run_strategy(name: str, steps: int, extra: list[str], out: Path, label: str | None = None) -> dict[str, Any]:
    run_dir = out / (label or name)
    overrides = [
        f"strategy={name}",
        *JOB,
        f"trainer.max_steps={steps}",
        f"trainer.log_every={max(1, steps // 2)}",
        *extra,
    ]
    if name == "zero_infinity":
        (out / "nvme").mkdir(exist_ok=True)
        overrides.append(f"strategy.nvme_path={out / 'nvme'}")
    proc = subprocess.run(
        [LAUNCH, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=out, check=False
    )
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or ["(no stderr)"]
        return {"strategy": name, "error": f"exit {proc.returncode}: {lines[-1][:160]}"}
    last = json.loads(metrics.read_text().splitlines()[-1])  # the last window: steps after the first log
    row = {
        "strategy": name,
        **{
            k: last.get(k)
            for k in (
                "world_size",
                "step_time_s",
                "tokens_per_s",
                "model_state_bytes",
                "peak_memory_bytes",
                "plan_peak_bytes",
                "comm_bytes",
                "comm_sent_bytes",
                "comm_bytes_formula",
                "mfu",
            )
        },
    }
    if row["comm_sent_bytes"] is not None and row["comm_bytes_formula"]:
        row["measured_over_formula"] = row["comm_sent_bytes"] / row["comm_bytes_formula"]
    return row


RECIPES = {"AdamW": [], "AdamW + EMA": ["trainer.ema.decay=0.999"], "Muon + AdamW": ["optim=muon"]}
"""The optimizer recipe's costs (`--recipe`): each against plain AdamW, same strategy, same job."""


def recipe(strategies: list[str], steps: int, extra: list[str], out: Path) -> str:
    """Step time of EMA and of Muon against AdamW, per strategy: a table."""
    lines = ["| strategy | recipe | step time (s) | against AdamW |", "|---|---|---|---|"]
    for name in strategies:
        base = None
        for what, overrides in RECIPES.items():
            label = f"{name}-{what.replace(' ', '').replace('+', '-')}"
            row = run_strategy(name, steps, [*extra, *overrides], out, label)
            print(f"{label}: {row.get('error', 'ok')}", file=sys.stderr, flush=True)
            if "error" in row:
                lines.append(f"| {name} | {what} | failed: {row['error'].replace('|', '/')} | |")
                continue
            base = row["step_time_s"] if base is None else base
            lines.append(f"| {name} | {what} | {row['step_time_s']:.4f} | {row['step_time_s'] / base:.2f}x |")
    return "\n".join(lines)


def overhead(steps: int, out: Path) -> dict[str, dict[str, float]]:
    """bench/overhead.py's runs, once each: plain torchrun, launch, launch logging every step."""
    return compare(steps, 1, out)


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:.2f} MB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | failed: {r['error'].replace('|', '/')} |" + " |" * (len(COLUMNS) - 2))
            continue
        ratio = r.get("measured_over_formula")
        peak, planned = r["peak_memory_bytes"], r["plan_peak_bytes"]
        cells = [
            r["strategy"],
            f"{r['world_size']:.0f}",
            f"{r['step_time_s']:.4f}",
            f"{r['tokens_per_s']:.0f}",
            _mb(r["model_state_bytes"]),
            _mb(peak),
            _mb(planned),
            "—" if not (peak and planned) else f"{planned / peak:.2f}",
            _mb(r["comm_bytes"]),
            _mb(r["comm_sent_bytes"]),
            _mb(r["comm_bytes_formula"]),
            "—" if ratio is None else f"{ratio:.2f}",
            "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--device", default="cpu")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="per device, for MFU on a device the table lacks")
    p.add_argument("--only", nargs="*", default=None, help="strategy names (default: all but auto)")
    p.add_argument("--overhead-steps", type=int, default=20, help="0 skips the launch-vs-torchrun runs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--recipe", nargs="*", default=None, help="strategies: only EMA's and Muon's step time vs AdamW's")
    a = p.parse_args()
    extra = [f"device={a.device}", f"gpus={a.gpus}"] + (
        [f"trainer.peak_tflops={a.peak_tflops}"] if a.peak_tflops else []
    )
    if a.recipe is not None:
        with tempfile.TemporaryDirectory() as tmp:
            print(recipe(a.recipe or ["ddp", "fsdp"], a.steps, extra, Path(tmp)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name in a.only or strategies():
            rows.append(run_strategy(name, a.steps, extra, Path(tmp)))
            print(f"{name}: {rows[-1].get('error', 'ok')}", file=sys.stderr, flush=True)
        ratio = overhead(a.overhead_steps, Path(tmp)) if a.overhead_steps else None
    print(table(rows))
    print(
        "\ncomm payload: the buffers handed to the gradient-sync collectives; sent: the ring bytes this rank sends "
        "for every collective of the step (all-reduce 2(G-1)/G, reduce-scatter and all-gather (G-1)/G of the "
        "buffer; FSDP's and ZeRO-3's parameter all-gathers included), beside the planner's formula. planned peak: "
        "the planner's figure for the same run (plan_peak_bytes), against the measured peak."
    )
    if ratio:
        print(f"\nlaunch against plain torchrun (DDP, 2 CPU ranks, {a.overhead_steps} steps, one run each):\n")
        print(report(ratio))
    if a.json:
        a.json.write_text(json.dumps({"strategies": rows, "overhead": ratio}, indent=2))


if __name__ == "__main__":
    main()
