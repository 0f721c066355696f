"""The parent's checks of a frozen config, before any worker starts, in the order they run: each failure is a
ConfigError (one line). Each concern's checks live beside it: the data's in `launcher.data.checks` (and a mixture's
in `launcher.mixture.checks`), the model's in `launcher.models.checks`, the optimizer's in `launcher.optim.checks`,
the evaluation's in `launcher.evaluation.checks`, the loggers' in `launcher.loggers.checks`, the keys' in
`launcher.config.known`, a strategy's in its own `check`; the resume's is here. `check_config` calls them in their
one order, for a launch and for each job of a sweep.

They take the model built once on the meta device (`launcher.models.meta`), so nothing here builds it again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.machine import visible_cuda_devices
from launcher.clusters import shaped
from launcher.config import ConfigError, Derived, derive, freeze
from launcher.config.context import check_protocol, check_strategy
from launcher.config.identity import sweep_identity
from launcher.config.known import check_keys
from launcher.data.checks import check_datasets, check_vocabulary, prepare_data
from launcher.evaluation.checks import check_evaluation
from launcher.export.harness import check_harness
from launcher.loggers.checks import check_loggers
from launcher.models.checks import check_forward, check_trainable, outside_moe_blocks, vocabulary
from launcher.optim.checks import check_optimizer

if TYPE_CHECKING:
    from launcher.base.storage import Location


def check_resume(frozen: DictConfig, run_dir: Path, model: Any) -> Location | None:
    """The checkpoint `resume=` names (a local path or a URL), checked against the model's shapes; None when there is
    none. trainer.checkpoint_dir, when set, is checked first (`check_folder`)."""
    from launcher.base.storage import checkpoints_of
    from launcher.checkpoint.format import CheckpointError, read_manifest
    from launcher.checkpoint.loading import check_fits, check_folder, find_resume
    from launcher.mixture.checks import check_mixture_resume

    try:
        identity = {"config_hash": frozen.job.config_hash, "sweep_dir": frozen.job.get("sweep_dir")}
        if identity["sweep_dir"]:  # a sweep's job: the same job of an earlier sweep, by its overrides
            identity["overrides"] = sweep_identity(frozen.job.overrides)
        checkpoints = checkpoints_of(frozen.trainer, run_dir) if frozen.trainer.get("checkpoint_dir") else None
        if checkpoints is not None:  # trainer.checkpoint_dir: reachable, and this run's
            check_folder(checkpoints, identity)
        found = find_resume(frozen.resume, run_dir, identity, checkpoints)
        if found is not None:
            check_fits(found, model)
            if not frozen.trainer.eval_only:  # launch eval trains nothing: a finished run's checkpoint is fine
                _check_steps_left(found, frozen.trainer.max_steps)
            check_mixture_resume(frozen, found, read_manifest(found))  # data=mix's positions, or another data's
    except CheckpointError as e:
        raise ConfigError(str(e)) from e
    if frozen.resume == "auto":
        print(f"launch: resume=auto: {f'resuming from {found}' if found else 'no earlier checkpoint, starting fresh'}")
    return found


def _check_steps_left(checkpoint: Location, max_steps: int) -> None:
    """A checkpoint at or past trainer.max_steps leaves nothing to train: refused, not a run that says nothing."""
    from launcher.checkpoint.format import read_manifest
    from launcher.checkpoint.untrusted import UntrustedDataError

    try:
        step = read_manifest(checkpoint)["step"]
    except UntrustedDataError as e:
        raise ConfigError(f"{e}; resume from another one") from e
    if step >= max_steps:
        raise ConfigError(
            f"resume={checkpoint} is at step {step}, and trainer.max_steps={max_steps} leaves nothing to train; "
            f"raise trainer.max_steps above {step}"
        )


@dataclass
class Checked:
    """What the checks leave for the launch: the config as it will run (a cluster's shape, strategy=auto's pick and
    batch.micro_size=auto's choice in it), what is derived of it, the model built once on the meta device, its
    vocabulary, the trainable parameters that got no gradient (None where the forward could not run), the strategy
    the config names and, under strategy=auto, the name picked."""

    frozen: DictConfig
    derived: Derived
    model: Any
    vocab: int | None
    no_grad: list[str] | None
    strategy: Any
    picked: str | None


def check_config(cfg: DictConfig, overrides: list[str], run_dir: Path | None, quiet: bool = False) -> Checked:
    """Check the composed config, in the order the checks run, and build in the parent what the workers will build:
    refuse in one line (ConfigError) what fails. The model's own sanity first (a parameter to train: what the rest
    groups and steps), the optimizer over the model's (meta) parameters, the loggers' settings, the evaluation's
    metrics, the data's own preparation (data=text tokenizes here), both datasets and their first samples, the token
    ids against the model's vocabulary, a forward and backward of one micro-batch on the meta device; then the plan's
    choices, printed unless `quiet` (a sweep's jobs print their own as they start). Nothing here allocates a model's
    memory. `run_dir`'s record of an out-of-memory restart is read (a damaged one refused) where there is one."""
    import contextlib
    import io

    from launcher.mixture.checks import check_mixture
    from launcher.mixture.mix import MIX_TARGET
    from launcher.models.meta import build_on_meta
    from launcher.models.meta import measure as model_size
    from launcher.plan.commands import choose, choose_micro, is_auto
    from launcher.recovery.adapt import read_adapted

    frozen = shaped(freeze(cfg), os.environ, overrides)  # a cluster's nodes and gpus
    cuda = visible_cuda_devices()
    derived = derive(frozen, cuda)
    if derived.micro_auto:  # checked and planned (strategy=auto) at one sample; chosen once the strategy is
        frozen.batch.micro_size = 1
    if derived.forks_workers(frozen.trainer):
        # Not one OpenMP thread in this process before the workers fork from it: GNU OpenMP's pool does not survive
        # a fork (a forked worker would wait forever in its first parallel region, after a check below ran a
        # multi-threaded op on a user's data); the workers size their own (`after_fork`).
        import torch

        torch.set_num_threads(1)
    check_keys(frozen)
    model = build_on_meta(frozen.model)  # once: every check below reads this one
    check_trainable(model, frozen.model.get("_target_"))
    vocab = vocabulary(model)
    print(check_optimizer(frozen, model), flush=True)  # its param groups, named with their sizes
    check_loggers(frozen)  # the cheap ones first: data=text may tokenize for minutes
    check_evaluation(frozen)  # the metrics build, the early stop's figure is logged
    check_harness(frozen, model)  # lm-eval's tasks (launch eval): installed, found, the model exportable
    prepare_data(frozen)
    sample = check_datasets(frozen, check_mixture if str(frozen.data._target_) == MIX_TARGET else None)
    check_vocabulary(frozen, vocab)  # the data's token ids, before the model reads them
    no_grad = check_forward(frozen, model, sample) if sample is not None else None
    if no_grad is not None:  # none of a mixture-of-experts block's: every strategy gives those one
        no_grad = outside_moe_blocks(model, no_grad, frozen.strategy.get("moe_blocks"))
    sizes = model_size(model) if is_auto(frozen) or derived.micro_auto else None  # the planner's, measured once
    picked = None
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        if is_auto(frozen):  # strategy=auto: the planner's pick replaces it before anything else reads the config
            picked, frozen, derived = choose(frozen, derived, model, sizes, cuda)
        strategy = check_protocol(frozen)  # before the planner reads it (a user's, written to an older protocol)
        # The run directory's record is data: a damaged one is refused, whatever the micro-batch.
        adapted = read_adapted(run_dir) if run_dir is not None else None
        if derived.micro_auto:  # the largest micro-batch that fits, at most what an out-of-memory error left
            frozen, derived = choose_micro(frozen, derived, sizes, strategy, adapted, run_dir)
    return Checked(frozen, derived, model, vocab, no_grad, strategy, picked)


def check_job(cfg: DictConfig) -> None:
    """The checks `prepare` makes, for a config composed outside of a job: a sweep's jobs, each checked before the
    first one starts. ConfigError (one line) for the first that fails; nothing is written. What the checks print is
    what a single run prints at start (the caller shows it once for the sweep), but the plan's choices (strategy=auto's
    table, batch.micro_size=auto's line), which the job prints as it starts."""
    from launcher.plan.pipeline import check_pipeline_nodes

    checked = check_config(cfg, [], None, quiet=True)
    frozen, derived = checked.frozen, checked.derived
    check_strategy(OmegaConf.merge(frozen, {"derived": derived.as_dict()}), checked.model)
    check_pipeline_nodes(frozen, derived, checked.model)
