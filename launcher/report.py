"""The sweep report: at the end of a multirun, `summary.md` and `summary.png` in the sweep directory.

Built only from what the jobs wrote (`resolved.yaml`, `metrics.jsonl`), so it also works on a
sweep that ran elsewhere: `python -m launcher.report <sweep dir>`.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


@dataclass
class Job:
    name: str
    strategy: str
    world_size: int | None
    accumulation: int | None
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[tuple[int, float]]:
        return [(m["step"], m["loss"]) for m in self.metrics if "loss" in m]

    @property
    def samples_per_s(self) -> float | None:
        rates = [m["samples_per_s"] for m in self.metrics[1:] if "samples_per_s" in m]  # step 1 is warm-up
        return statistics.median(rates) if rates else None

    def last(self, key: str) -> Any:
        return next((m[key] for m in reversed(self.metrics) if key in m), None)


def collect(sweep_dir: Path) -> list[Job]:
    runs = sorted(sweep_dir.glob("*/resolved.yaml"), key=lambda p: (len(p.parent.name), p.parent.name))
    overrides = [_overrides(p.parent) for p in runs]
    varying = {k for o in overrides for k in o if len({str(other.get(k)) for other in overrides}) > 1}
    jobs = []
    for resolved, job_overrides in zip(runs, overrides):
        cfg = OmegaConf.load(resolved)
        metrics_file = resolved.parent / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
        label = " ".join(f"{k}={v}" for k, v in job_overrides.items() if k in varying)
        jobs.append(
            Job(
                name=f"{resolved.parent.name}" + (f": {label}" if label else ""),
                strategy=str(OmegaConf.select(cfg, "job.choices.strategy", default="?")),
                world_size=OmegaConf.select(cfg, "derived.world_size"),
                accumulation=OmegaConf.select(cfg, "derived.accumulation"),
                metrics=metrics,
            )
        )
    return jobs


def _overrides(job_dir: Path) -> dict[str, str]:
    """The job's command-line overrides, as the launcher recorded them in resolved.yaml."""
    items = OmegaConf.select(OmegaConf.load(job_dir / "resolved.yaml"), "job.overrides", default=None) or []
    return dict(str(o).lstrip("+~").split("=", 1) for o in items if "=" in str(o))


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(jobs: list[Job]) -> str:
    lines = [
        "| job | strategy | world size | accumulation | final loss | samples/s | model-state bytes per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for j in jobs:
        lines.append(
            f"| {j.name} | {j.strategy} | {_fmt(j.world_size, 'd')} | {_fmt(j.accumulation, 'd')} | "
            f"{_fmt(j.last('loss'), '.4f')} | {_fmt(j.samples_per_s, '.1f')} | "
            f"{_fmt(j.last('model_state_bytes'), ',.0f')} |"
        )
    return "\n".join(lines) + "\n"


def chart(jobs: list[Job], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for j in jobs:
        if j.losses:
            steps, losses = zip(*j.losses)
            curves.plot(steps, losses, label=j.name, marker="." if len(steps) < 30 else None)
    curves.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    curves.legend(fontsize="small")
    names = [j.name for j in jobs]
    bars.barh(names, [j.samples_per_s or 0 for j in jobs], color="tab:blue")
    bars.set(title="throughput (median samples/s)", xlabel="samples/s")
    bars.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(sweep_dir: Path) -> list[Job]:
    jobs = collect(sweep_dir)
    if jobs:
        (sweep_dir / "summary.md").write_text(markdown(jobs))
        chart(jobs, sweep_dir / "summary.png")
    return jobs


class SweepReport(Callback):
    """Hydra callback: writes the report after the last job of a multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = write_report(sweep_dir)
        if jobs:
            print(
                f"launch: sweep report of {len(jobs)} job(s): {sweep_dir / 'summary.md'}, {sweep_dir / 'summary.png'}"
            )


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
