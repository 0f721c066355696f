"""The suite's shared runs: every strategy's conformance run (made once per session, whichever test process asks
first, and read by the checkpoint, FSDP, planner, memory and speed tests too), and the smoke sweeps of user models."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from conftest import TINY, Run, launch_once, require_async_io

STRATEGIES = sorted(
    p.name.removesuffix(".yaml")
    for p in (resources.files("launcher.conf") / "strategy").iterdir()
    if p.name.endswith(".yaml")
)
STRATEGIES.remove("auto")  # a request, not a strategy: launch.prepare() swaps in a preset (tests/test_plan.py)


def _declared() -> dict:
    """Each preset's strategy, built from its config as a run builds it: what it declares of itself is what the suite
    expects of it (`Strategy.conformance`, `Strategy.requirements`), with no list of the suite's own."""
    from launcher.config import schema
    from launcher.config.context import preset_strategies

    schema.register()
    return preset_strategies(STRATEGIES)


DECLARED = _declared()
PARITY_TOLERANCE = {s: d.conformance().tolerance for s, d in DECLARED.items()}
"""strategy -> the largest loss difference from one process it declares (`Conformance.tolerance`): what every test
comparing a strategy's losses with one process's holds it to, never more."""
NORM_TOLERANCE = {s: d.conformance().norm_tolerance for s, d in DECLARED.items()}
"""strategy -> the largest relative difference of its gradient norm from one process's (`Conformance.norm_tolerance`),
what every test comparing the norms holds it to."""
SHAPES = {
    s: (c.ranks, list(c.overrides)) for s, d in DECLARED.items() if (c := d.conformance()).ranks != 2 or c.overrides
}
"""strategy -> the suite's ranks and overrides for it, where it declares other than 2 ranks and none (hsdp: 2
replicas x 2 shards at the same K = 2 as the others; every hsdp check reads that one 4-rank run)."""
REQUIRED = {s: ["strategy.nvme_path={tmp}"] for s, d in DECLARED.items() if d.requirements().nvme_folder}
AT_TWO_RANKS = [s for s in STRATEGIES if s not in SHAPES]
NEEDS_ASYNC_IO = {s for s, d in DECLARED.items() if "async_io" in d.requirements().ops}  # NVMe offload: libaio

STEPS = 12
# One job for every suite that needs a whole run of a strategy: these runs also save at step 6,
# so the checkpoint tests resume from them instead of repeating them.
JOB = [
    *(o for o in TINY if not o.startswith("trainer.eval_every")),
    "trainer.eval_every=6",  # the validation loss at steps 6 and 12, over one global batch
    "trainer.eval_batches=1",
    "data=pysource",
    "data.packing=false",  # padded samples: each holds its own number of targets (the batch contract on real data)
    "batch.global_size=16",
    "batch.micro_size=4",
    f"trainer.max_steps={STEPS}",
    "trainer.warmup_steps=4",
    "optim.lr=3e-3",
    "trainer.checkpoint_every=6",
    "trainer.keep_last=0",
]


@functools.cache
def shared_run(tmp: Path, *overrides: str) -> Run:
    name = "-".join(o.replace("/", "_").replace("=", "_") for o in overrides) or "default"
    return launch_once(tmp, *JOB, *overrides, name=name).check()


def run_of(tmp: Path, strategy: str, gpus: int, *extra: str) -> Run:
    """The suite's one run of `strategy` on `gpus` ranks (with `extra` overrides), made on first use."""
    return shared_run(tmp, *selecting(tmp, strategy), f"gpus={gpus}", *extra)


def reference(tmp: Path) -> Run:
    """One process, plain DDP, the same global batch: K = 4."""
    return run_of(tmp, "ddp", 1)


def selecting(tmp: Path, strategy: str) -> tuple[str, ...]:
    if strategy in NEEDS_ASYNC_IO:
        require_async_io()
    return (f"strategy={strategy}", *(o.format(tmp=tmp) for o in REQUIRED.get(strategy, [])))


def ranks(strategy: str) -> int:
    return SHAPES.get(strategy, (2, []))[0]


def suite_run(tmp: Path, strategy: str) -> Run:
    """The suite's run of `strategy`: on 2 ranks, or in the shape SHAPES gives it."""
    gpus, extra = SHAPES.get(strategy, (2, []))
    return run_of(tmp, strategy, gpus, *extra)


def two_ranks(tmp: Path, strategy: str) -> Run:
    return run_of(tmp, strategy, 2)


def smoke(tmp: Path, name: str, *overrides: str) -> tuple[Run, Path]:
    """`launch -m +sweep=smoke ...` once per session; its sweep directory."""
    sweep = tmp / name
    run = launch_once(tmp, "-m", "+sweep=smoke", *overrides, f"hydra.sweep.dir={sweep}", name=name)
    return run, sweep


def sweep_parts(stdout: str) -> tuple[str, str]:
    """A local sweep's output split where Hydra starts its jobs: the sweep's checks of every job (each line shown
    once), and what the jobs printed."""
    checks, _, ran = stdout.partition("] Launching ")
    return checks, ran


def jobs(sweep: Path) -> dict[str, Path]:
    """strategy -> job folder."""
    return {json.loads((d / "outcome.json").read_text())["strategy"]: d for d in sweep.iterdir() if d.is_dir()}


def metrics(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


CLASSIFIER = [
    "model=custom",
    "model._target_=user_models.Classifier",
    "+model.width=8",
    "data=custom",
    "data._target_=user_models.images",
]
