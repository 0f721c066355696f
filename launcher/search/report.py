"""The sweep report: at the end of a multirun, a table of every job's outcome on the terminal, `summary.md` and
`summary.png` in the sweep directory, and a non-zero exit if any job did not finish.

Built only from what the jobs wrote (`outcome.json`, `resolved.yaml`, `metrics.jsonl`), so it also works on a
sweep that ran elsewhere: `python -m launcher.search.report <sweep dir>`. What it reads is data: parsed, never run.
"""

from __future__ import annotations

import fcntl
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
    code: int | None = None
    """The job's exit code (None: no outcome recorded, e.g. a sweep from before outcomes)."""
    reason: str = ""
    seconds: float | None = None
    trial: dict[str, Any] | None = None
    """A search's trial, as its outcome records it: number, parameters, state (complete, pruned, failed), objective
    and direction."""

    @property
    def status(self) -> str:
        if self.trial is not None:
            return str(self.trial["state"])
        if self.code is None:
            return "?"
        return {0: "ok", 2: "refused"}.get(self.code, "stopped" if self.code >= 128 else "failed")

    @property
    def losses(self) -> list[tuple[int, float]]:
        return [(m["step"], m["loss"]) for m in self.metrics if m.get("loss") is not None]  # null: not finite

    @property
    def samples_per_s(self) -> float | None:
        rates = [m["samples_per_s"] for m in self.metrics[1:] if "samples_per_s" in m]  # step 1 is warm-up
        return statistics.median(rates) if rates else None

    def last(self, key: str) -> Any:
        return next((m[key] for m in reversed(self.metrics) if key in m), None)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(sweep_dir: Path) -> list[Job]:
    folders = {p.parent for pattern in ("*/resolved.yaml", "*/outcome.json") for p in sweep_dir.glob(pattern)}
    folders_sorted = sorted(folders, key=lambda p: (len(p.name), p.name))
    outcomes = [_read_json(f / "outcome.json") or {} for f in folders_sorted]
    overrides = [_overrides(f, o) for f, o in zip(folders_sorted, outcomes)]
    varying = {k for o in overrides for k in o if len({str(other.get(k)) for other in overrides}) > 1}
    varying = {k for k in varying if not k.startswith("sweep.")}  # a trial's number and study: not its parameters
    jobs = []
    for folder, outcome, job_overrides in zip(folders_sorted, outcomes, overrides):
        cfg = OmegaConf.load(folder / "resolved.yaml") if (folder / "resolved.yaml").exists() else OmegaConf.create()
        metrics_file = folder / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
        trial = _trial(outcome)  # a search's trial: named by its parameters
        label = trial["params"] if trial else " ".join(f"{k}={v}" for k, v in job_overrides.items() if k in varying)
        strategy = OmegaConf.select(cfg, "job.choices.strategy", default=None) or outcome.get("strategy") or "?"
        jobs.append(
            Job(
                name=f"{folder.name}" + (f": {label}" if label else ""),
                strategy=str(strategy),
                world_size=OmegaConf.select(cfg, "derived.world_size"),
                accumulation=OmegaConf.select(cfg, "derived.accumulation"),
                metrics=metrics,
                code=outcome.get("code"),
                reason=str(outcome.get("reason", "")),
                seconds=outcome.get("seconds"),
                trial=trial,
            )
        )
    return jobs


def _trial(outcome: dict[str, Any]) -> dict[str, Any] | None:
    """A search trial's outcome (its sweeper wrote its parameters into it), its parameters as overrides."""
    if "state" not in outcome or not isinstance(outcome.get("params"), dict):
        return None
    shown = (f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in outcome["params"].items())
    return {**outcome, "params": " ".join(shown)}  # exact values: the study, and the run's resolved.yaml


def trials(jobs: list[Job]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A search's trials in the order they ran (by number), and the best complete one (None: none completed, or a
    study of several objectives, which has a front instead: `front`)."""
    ran = sorted((j.trial for j in jobs if j.trial is not None), key=lambda t: t["trial"])
    done = [t for t in ran if t["state"] == "complete" and t.get("objective") is not None]
    if not done or isinstance(done[0]["objective"], list):
        return ran, None
    sign = -1.0 if done[0].get("direction") == "maximize" else 1.0
    return ran, min(done, key=lambda t: sign * t["objective"])


def front(ran: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A multi-objective study's Pareto front: its complete trials that no other complete trial is at least as good
    as on every objective and better on one."""
    done = [t for t in ran if t["state"] == "complete" and isinstance(t.get("objective"), list)]
    if not done:
        return []
    signs = [-1.0 if d == "maximize" else 1.0 for d in done[0]["direction"]]
    keys = [[s * v for s, v in zip(signs, t["objective"])] for t in done]

    def beats(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [t for t, k in zip(done, keys) if not any(beats(other, k) for other in keys)]


def trials_table(jobs: list[Job]) -> str:
    """The search's trials: parameters, objective (one column per objective, its direction), state; the best marked,
    or every trial of a multi-objective study's Pareto front."""
    ran, best = trials(jobs)
    if not ran:
        return ""
    names, directions = ran[0].get("objective_name"), ran[0].get("direction")
    several = isinstance(names, list)
    on_front = front(ran) if several else []
    shown = [f"{n} ({'min' if d == 'minimize' else 'max'})" for n, d in zip(names, directions)] if several else [names]
    lines = [f"| trial | parameters | {' | '.join(shown)} | state | |", "|---" * (len(shown) + 4) + "|"]
    for t in ran:
        note = "best" if t is best else (f"at step {t['pruned_at']}" if t.get("pruned_at") else t.get("reason", ""))
        note = "Pareto front" if any(t is f for f in on_front) else note
        value = t.get("objective")
        values = value if isinstance(value, list) else [value] + [None] * (len(shown) - 1)
        cells = " | ".join(_fmt(v, ".6g") for v in values)
        lines.append(f"| {t['trial']} | {t['params']} | {cells} | {t['state']} | {note} |")
    return "\n".join(lines) + "\n"


def _overrides(job_dir: Path, outcome: dict[str, Any]) -> dict[str, str]:
    """The job's command-line overrides, as the launcher recorded them."""
    items = outcome.get("overrides")
    if items is None and (job_dir / "resolved.yaml").exists():
        items = OmegaConf.select(OmegaConf.load(job_dir / "resolved.yaml"), "job.overrides", default=None)
    return dict(str(o).lstrip("+~").split("=", 1) for o in items or [] if "=" in str(o))


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def outcomes(jobs: list[Job]) -> str:
    """The terminal table: one row per job, its outcome, the one-line reason and how long it took."""
    rows = [("job", "strategy", "status", "seconds", "reason")]
    rows += [(j.name, j.strategy, j.status, _fmt(j.seconds, ".1f"), j.reason) for j in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4] for r in rows)


def markdown(jobs: list[Job]) -> str:
    search = trials_table(jobs)
    lines = [
        *([search] if search else []),
        "| job | strategy | status | seconds | world size | accumulation | final loss | samples/s "
        "| model-state bytes per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for j in jobs:
        lines.append(
            f"| {j.name} | {j.strategy} | {j.status} | {_fmt(j.seconds, '.1f')} | "
            f"{_fmt(j.world_size, 'd')} | {_fmt(j.accumulation, 'd')} | "
            f"{_fmt(j.last('loss'), '.4f')} | {_fmt(j.samples_per_s, '.1f')} | "
            f"{_fmt(j.last('model_state_bytes'), ',.0f')} |"
        )
    return "\n".join(lines) + "\n"


def chart(jobs: list[Job], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    ran, best = trials(jobs)
    fig, (curves, bars, *search) = plt.subplots(1, 3 if ran else 2, figsize=(18 if ran else 12, 4.5))
    names = [f"trial {j.trial['trial']}" if j.trial else j.name for j in jobs]  # a trial's parameters: in the table
    for j, name in zip(jobs, names):
        if j.losses:
            steps, losses = zip(*j.losses)
            curves.plot(steps, losses, label=name, marker="." if len(steps) < 30 else None)
    curves.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    curves.legend(fontsize="small")
    bars.barh(names, [j.samples_per_s or 0 for j in jobs], color="tab:blue")
    bars.set(title="throughput (median samples/s)", xlabel="samples/s")
    bars.invert_yaxis()
    several = bool(ran) and isinstance(ran[0].get("objective_name"), list)
    if several:  # the first two objectives against each other, the front drawn
        names, on_front = ran[0]["objective_name"], front(ran)
        done = [t["objective"] for t in ran if t["state"] == "complete" and isinstance(t.get("objective"), list)]
        if done:
            search[0].scatter([v[0] for v in done], [v[1] for v in done], marker="o", label="complete")
        if on_front:
            edge = sorted((t["objective"][0], t["objective"][1]) for t in on_front)
            search[0].plot(*zip(*edge), color="tab:red", marker="o", fillstyle="none", label="Pareto front")
        search[0].set(title="trials", xlabel=names[0], ylabel=names[1])
        search[0].legend(fontsize="small")
    elif ran:
        for state, marker in (("complete", "o"), ("pruned", "x")):
            shown = [
                (t["trial"], t["objective"]) for t in ran if t["state"] == state and t.get("objective") is not None
            ]
            if shown:
                search[0].scatter(*zip(*shown), marker=marker, label=state)
        if best is not None:
            search[0].scatter(
                [best["trial"]], [best["objective"]], s=160, facecolors="none", edgecolors="tab:red", label="best"
            )
        name = ran[0].get("objective_name")
        search[0].set(title=f"{name} per trial (pruned: when stopped)", xlabel="trial", ylabel=name)
        search[0].set_xlim(-0.5, ran[-1]["trial"] + 0.5)  # every trial's place, the failed ones' too
        search[0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        search[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT_LOCK = ".summary.lock"
"""Held while a sweeper reads the sweep folder and writes its report: of several sweepers on one study, the last to
write read every outcome written before it (one that read while another's last trial ran, and wrote after that one's
report, would leave a report without that trial)."""


def write_report(sweep_dir: Path) -> list[Job]:
    if not sweep_dir.is_dir():  # no job ran
        return []
    with open(sweep_dir / REPORT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed holder dies
        jobs = collect(sweep_dir)
        if jobs:
            (sweep_dir / "summary.md").write_text(markdown(jobs))
            chart(jobs, sweep_dir / "summary.png")
    return jobs


class SweepReport(Callback):
    """Hydra callback: after the last job of a multirun, the table and the report; exit 1 if any job did not finish."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = write_report(sweep_dir)
        if not jobs:
            return
        print((trials_table(jobs) or outcomes(jobs)).rstrip(), flush=True)  # a search: its trials
        print(f"launch: sweep report of {len(jobs)} job(s): {sweep_dir / 'summary.md'}, {sweep_dir / 'summary.png'}")
        ran, best = trials(jobs)
        unfinished = [j for j in jobs if j.code not in (0, None)]
        if ran:  # a search: failed trials are part of what it found (a learning rate that diverged), pruned ones too
            failed = all(t["state"] == "failed" for t in ran)
            _finish_parent_run(sweep_dir, "FAILED" if failed else "FINISHED")
            if failed:
                print(f"launch: error: all {len(ran)} trial(s) failed", file=sys.stderr, flush=True)
                raise SystemExit(1)
            return
        stopped = any(j.code is not None and j.code >= 128 for j in unfinished)
        _finish_parent_run(sweep_dir, "KILLED" if stopped else "FAILED" if unfinished else "FINISHED")
        if unfinished:
            print(f"launch: error: {len(unfinished)} of {len(jobs)} job(s) did not finish", file=sys.stderr, flush=True)
            raise SystemExit(1)


def _finish_parent_run(sweep_dir: Path, status: str) -> None:
    """A sweep whose jobs logged to MLflow: its parent run gets the report (summary.md, summary.png) and its status."""
    if not any(sweep_dir.glob("*/mlflow_run_id")):  # no job logged to MLflow: nothing to import
        return
    from launcher.loggers.mlflow_store import finish_sweep, redact

    try:
        parent = finish_sweep(sweep_dir, status, [sweep_dir / "summary.md", sweep_dir / "summary.png"])
    except Exception as e:  # the report is written either way; say why MLflow does not have it
        why = redact((str(e).strip().splitlines() or [""])[0])
        print(f"launch: the sweep's MLflow parent run was not finished ({type(e).__name__}: {why})", file=sys.stderr)
        return
    if parent is not None:
        print(f"mlflow: the sweep's parent run {parent}: {status}, with its report", flush=True)


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
