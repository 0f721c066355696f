"""The parent side of a run: freeze and check the config, write `resolved.yaml`, start the workers (`workers`).

cli (Hydra app) -> launch.run_job: freeze, derive, build the model on the meta device once, let strategy=auto
choose, check (strategy, resume), write resolved.yaml -> torch's elastic agent -> the workers (forked from here
on CPU, `python -m launcher.worker.main` on CUDA), each reading resolved.yaml; where the job runs: `launcher.clusters`
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.durable import disk_error
from launcher.base.process import release_collector
from launcher.config import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    ConfigError,
    Derived,
)
from launcher.config.context import check_strategy
from launcher.config.identity import identity_hash
from launcher.elastic.rendezvous import ETCD, Rendezvous, rendezvous
from launcher.export.harness import requested
from launcher.parent.checks import check_config, check_resume
from launcher.parent.run_id import claim_run
from launcher.parent.rundir import remove_made
from launcher.parent.workers import Outcome, Prepared, start_workers
from launcher.recovery.in_place import check_in_place
from launcher.recovery.replicas import holds_whole_state
from launcher.recovery.shm import check_memory_tier, tier_on


def prepare(cfg: DictConfig, run_dir: Path, job: dict[str, Any] | None = None) -> Prepared:
    """Check the composed config, claim the run directory, and write `<run_dir>/resolved.yaml`.

    Every check comes before the claim, and the claim before the first write: refused input writes nothing.
    `job` carries what Hydra knows of this job (its config-group choices, its overrides, its place in a sweep);
    it is recorded in the frozen config and names the job's wandb group and run.
    """
    from launcher.export.transformers_folder import tokenizer_record
    from launcher.optim.checks import measure
    from launcher.plan.commands import planned_peak, planned_state
    from launcher.plan.pipeline import check_pipeline_nodes
    from launcher.recovery.adapt import oom_restarts

    checked = check_config(cfg, (job or {}).get("overrides", []), run_dir)
    frozen, derived, model, strategy = checked.frozen, checked.derived, checked.model, checked.strategy
    if checked.picked and job and "choices" in job:  # strategy=auto: record what runs, for reports and names
        job = {**job, "choices": {**job["choices"], "strategy": checked.picked}}
    rdzv = rendezvous(frozen, derived, os.environ)
    resolved: dict[str, Any] = OmegaConf.to_container(frozen)  # type: ignore[assignment]
    size = measure(frozen, model)  # with what its optimizer gathers whole
    peak = planned_peak(frozen, derived, size, strategy)
    check_in_place(frozen, derived, strategy.requirements().set_up_again)
    if tier_on(frozen.trainer):  # its replicas' nodes, and its room in shared memory
        job_bytes = planned_state(frozen, derived, size, strategy)
        whole = holds_whole_state(strategy.layout())  # ddp: the state itself is the copy
        check_memory_tier(frozen.trainer, derived.nodes, derived.min_nodes, job_bytes, whole)
    resolved["derived"] = {
        **derived.as_dict(),
        "model": size.as_dict(),
        "plan_peak_bytes": peak,
        "vocab_size": checked.vocab,  # the workers check user data's token ids against it
        "no_grad": checked.no_grad,  # no gradient from the first micro-batch: the strategies' RunContext
        "cluster": rdzv.job.cluster,
        "shared_run_dir": rdzv.job.shared_run_dir,  # the nodes' ranks check that they see one run directory
        "tokenizer_hash": tokenizer_record(frozen.data),  # an export checks the tokenizer it copies is this one
    }
    resolved["job"] = {**(job or {}), "config_hash": identity_hash(frozen, cfg)}
    _name_logger_run(resolved)
    frozen = OmegaConf.create(resolved)
    requirements = check_strategy(frozen, model)
    check_pipeline_nodes(frozen, derived, model)  # a pipeline whose stages are on different nodes: worth it?
    found = check_resume(frozen, run_dir, model)
    ownership = claim_run(frozen, run_dir, found, rdzv.run_id if derived.nodes > 1 else None)  # and its run id
    path = run_dir / "resolved.yaml"
    # Atomic: in a SLURM allocation every node's launcher writes the same file on a shared disk.
    tmp = run_dir / f".resolved.{os.getpid()}.yaml"
    OmegaConf.save(frozen, tmp)
    os.replace(tmp, path)
    restarts = oom_restarts(frozen, derived) + int(frozen.trainer.max_restarts)
    return Prepared(path, derived, rdzv, ownership, restarts, requirements)


def _name_logger_run(resolved: dict[str, Any]) -> None:
    """In a sweep: one group per sweep (a search: per study) in each logger (wandb's group, MLflow's parent run,
    TensorBoard's folder), one run per job, unless the user named them."""
    loggers, job = resolved["logger"], resolved["job"]
    if not job.get("sweep_dir") or not isinstance(loggers, dict):
        return
    group = resolved["sweep"]["study"] or Path(job["sweep_dir"]).name
    for logger in loggers.values():
        for key, value in (("group", group), ("name", f"{group}-{job['num']}")):  # its overrides: in the logged config
            if isinstance(logger, dict) and key in logger and logger[key] is None:
                logger[key] = value


def describe(cfg: DictConfig, derived: Derived, rdzv: Rendezvous, run_dir: Path) -> str:
    b = cfg.batch
    where = f" via rendezvous {rdzv.endpoint} (id {rdzv.run_id})" if derived.nodes > 1 else ""
    if rdzv.job.cluster != "local":
        where += f", node {rdzv.job.node_rank} of a {rdzv.job.cluster} job"
    nodes, world = f"{derived.nodes} node(s)", f"world size {derived.world_size}"
    data = derived.world_size // derived.tensor_size  # a tensor-parallel group reads one micro-batch
    micro = b.global_size // (derived.accumulation * data)  # batch.micro_size=auto: the planner's
    if derived.min_nodes < derived.nodes:  # elastic: accumulation follows the world size the group starts with
        nodes = f"{derived.min_nodes} to {derived.nodes} nodes (elastic)"
        world = f"world size {derived.min_nodes * derived.gpus} to {derived.world_size}"
    line = (
        f"launch: {nodes} x {derived.gpus} {derived.device} worker(s) = {world}{where}; "
        f"batch: micro {micro}{' (auto)' if derived.micro_auto else ''} x accumulation {derived.accumulation} "
        f"x {f'world {data}' if data == derived.world_size else f'data-parallel {data}'} = global {b.global_size}; "
        f"run dir {run_dir}"
    )
    if derived.min_nodes < derived.nodes and rdzv.backend == ETCD:
        line += f"; it outlives any of its nodes (the rendezvous store is etcd's, at rdzv.endpoint={rdzv.endpoint})"
    elif derived.min_nodes < derived.nodes:  # the one node an elastic job cannot lose
        line += f"; it outlives any node but the one hosting rdzv.endpoint={rdzv.endpoint} (the rendezvous store)"
    return line


def hydra_job() -> tuple[Path, dict[str, Any]]:
    """The job's output directory and what Hydra knows of it (choices, and its sweep if any)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    job: dict[str, Any] = {
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        "overrides": list(hc.overrides.task),
    }
    if hc.mode == RunMode.MULTIRUN:
        job |= {"sweep_dir": str(Path(hc.sweep.dir).resolve()), "num": hc.job.num}
    return Path(hc.runtime.output_dir), job


OUTCOME = "outcome.json"
"""A sweep job's outcome in its folder, for the sweep's report: code, reason, seconds."""


def run_job(cfg: DictConfig) -> int | dict[str, Any]:
    """One run: the task function of the Hydra app (called once per job in a multirun, once per node on SLURM).

    In a sweep a job that fails does not end the sweep: its outcome is recorded for the report, which lists every
    job and makes the sweep exit non-zero if any failed; a search's trial returns it, with its state and objective.
    """
    started = time.monotonic()
    run_dir, job = hydra_job()
    outcome = _run(cfg, run_dir, job)
    release_collector()  # where no worker started (a refusal): the next job of a sweep is collected
    if outcome.reason and not outcome.code >= 128:  # a stop already said where its checkpoint is
        for line in (outcome.reason, *outcome.more):
            print(f"launch: error: {line}", file=sys.stderr, flush=True)
    if "sweep_dir" not in job:
        return outcome.code
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "code": outcome.code,
        "reason": outcome.reason,
        "seconds": round(time.monotonic() - started, 1),
        "strategy": job["choices"].get("strategy"),
        "overrides": job["overrides"],
    }
    from launcher.search.objective import trial_outcome

    record |= trial_outcome(cfg, run_dir, outcome.code, outcome.reason)  # {} outside a search
    (run_dir / OUTCOME).write_text(json.dumps(record))
    return record if "state" in record else 0


def _run(cfg: DictConfig, run_dir: Path, job: dict[str, Any]) -> Outcome:
    try:
        prepared = prepare(cfg, run_dir, job)
    except (ConfigError, OSError) as e:
        if "sweep_dir" not in job:
            remove_made(run_dir)  # a refused run leaves nothing behind, and removes nothing it did not make
        if isinstance(e, OSError):  # the run directory cannot be written: a full disk, a read-only mount
            return Outcome(EXIT_FAILED, disk_error(e, run_dir))
        return Outcome(EXIT_BAD_INPUT, str(e))
    print(describe(cfg, prepared.derived, prepared.rdzv, run_dir), flush=True)
    try:
        outcome = start_workers(prepared, cfg.trainer, run_dir)
        if outcome.code == 0 and requested(cfg):  # launch eval harness.tasks=[...]: lm-eval, after the validation
            from launcher.parent.harness import run_harness

            reason = run_harness(cfg, run_dir, prepared.derived.device)
            return Outcome(EXIT_FAILED, reason) if reason else outcome
        return outcome
    finally:
        prepared.ownership.release()
