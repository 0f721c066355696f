"""The `launch` console script: a Hydra app over conf/, with one-line errors for bad input.

A single run is composed once, by the compose API, and that config is the job's (`run_once`, Hydra's own
`run_job`); sweeps, cluster submissions and Hydra's flags go through the Hydra app. Importing this module costs
nothing but the interpreter: `launch --help` lists the groups from conf/ without Hydra or OmegaConf, `--cfg job`
composes without torch, deepspeed or wandb, and the run itself is imported when a job starts.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import Any

HELP = """launch: train a model under any data-parallel strategy (DDP, FSDP2, DeepSpeed ZeRO).

Usage:
  launch [group=option] [key=value] ...      e.g. launch strategy=zero3 gpus=8 model=gpt_1b
  launch plan [overrides]                    memory and communication per rank; nothing runs
  launch convert CHECKPOINT out=FILE         consolidated weights as safetensors (out=DIR: a transformers folder)
  launch eval CHECKPOINT [overrides]         the validation sets and metrics of a checkpoint, no training: eval.json
                                             (harness.tasks=[...]: lm-evaluation-harness's tasks too)
  launch prepare data=text [data.*] out=URL  a token store in shards (a folder or s3://...) for data=store
  launch export kubeflow image=IMAGE [overrides]   a Kubeflow PyTorchJob that runs this config on its pods
  launch -m [overrides]                      a sweep, e.g. launch -m +sweep=strategies
  launch --cfg job [overrides]               the composed config (override anything: foo.bar=value); nothing runs

== Configuration groups (group=option) ==
{groups}
Several loggers at once: 'logger=[wandb,mlflow]', each one's settings under its name (logger.mlflow.experiment=x).

Hydra's own flags: launch --hydra-help"""


def fail(message: str, code: int | None = None) -> None:
    """Print a one-line error and exit non-zero (2, bad input, unless told)."""
    from launcher.config import EXIT_BAD_INPUT

    print(f"launch: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT if code is None else code)


def _task(cfg: Any) -> int | dict[str, Any]:
    """The task of one job: the run (`launcher.parent.launch.run_job`), imported only once a job really starts
    (torch)."""
    from launcher.parent.launch import run_job

    return run_job(cfg)


def _app() -> None:
    """Sweeps, submissions to a cluster and Hydra's own flags (--cfg, --hydra-help, --info): Hydra's app, as it is."""
    import hydra

    from launcher.parent.overrides import CONFIG_MODULE, CONFIG_NAME

    @hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
    def app(cfg: Any) -> dict[str, Any] | None:
        code = _task(cfg)
        if isinstance(code, dict):  # a search's trial: its outcome and objective, for the sweeper
            return code
        if code:
            raise SystemExit(code)

    app()


def print_help() -> None:
    """`launch --help`: the usage and each group's options (its YAML files, not the schemas stored under them)."""
    from launcher.config.groups import choices

    print(HELP.format(groups="\n".join(f"{group}: {', '.join(names)}" for group, names in choices().items())))


def console() -> None:
    """The `launch` console script: `main`, then an exit that skips the interpreter's teardown (`exit_now`). Its
    start-up is not collected (`hold_collector`) until the workers are about to start (`release_collector`)."""
    from launcher.base.process import exit_now, hold_collector

    hold_collector()
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):  # what Python itself would do with a message
            print(e.code, file=sys.stderr)
        exit_now(e.code if isinstance(e.code, int) else int(e.code is not None))
    exit_now(0)


def main(argv: Sequence[str] | None = None) -> None:
    # torch's C++ warnings (a store or a peer gone: a stack of C++ frames each) stay off the terminal, in the launcher
    # and its workers: what failed is said in one line, the agent's account in <run dir>/logs/agent.log. Read by
    # torch when it is imported, so set before; a value of the user's own stands.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    argv = list(sys.argv[1:] if argv is None else argv)
    if ("--help" in argv or "-h" in argv) and argv[:1] not in (
        ["plan"],
        ["convert"],
        ["export"],
        ["prepare"],
        ["eval"],
    ):
        return print_help()
    from launcher.base.storage import secret_in

    if secret := secret_in(argv):  # before Hydra logs, records or composes any of them
        fail(secret)
    from hydra.core.plugins import Plugins

    from hydra_plugins.launch_optuna import sweeper  # hydra/sweeper=launch_optuna, stored as the module is imported
    from launcher.config import schema

    schema.register()
    Plugins.instance().register(sweeper.LaunchOptunaSweeper)  # Hydra's own scan misses it in an editable install
    if argv[:1] in (["convert"], ["plan"], ["export"], ["prepare"]):
        from launcher.base.process import release_collector

        release_collector()  # a command that does its work in this process: collected as any program is
    if argv[:1] == ["convert"]:
        return convert(argv[1:])
    if argv[:1] == ["plan"]:
        raise SystemExit(plan(argv[1:]))
    if argv[:1] == ["export"]:
        return export(argv[1:])
    if argv[:1] == ["prepare"]:
        return prepare(argv[1:])
    if argv[:1] == ["eval"]:  # the training run's overrides, with the checkpoint resumed and evaluated once
        from launcher.base.errors import ConfigError
        from launcher.parent.eval_command import eval_overrides

        try:
            argv = eval_overrides(argv[1:])
        except ConfigError as e:
            fail(str(e))
    overrides = _single_run(argv)
    if overrides is not None:
        raise SystemExit(run_once(overrides))
    from launcher.parent.overrides import precheck

    error = precheck(argv)
    if error:
        fail(error)
    from launcher.clusters import submission

    try:
        argv += submission(argv)  # a submission to a cluster (hydra/launcher=submitit_slurm): the run's shape
    except ValueError as e:
        fail(str(e))
    if any(a.startswith("hydra.launcher._target_=hydra_plugins.launch_submitit.") for a in argv):
        from hydra_plugins.launch_submitit.slurm import SlurmLauncher

        Plugins.instance().register(SlurmLauncher)  # as the sweeper above: Hydra's scan misses it when editable
    sys.argv = [sys.argv[0], *argv]
    _app()


def _single_run(argv: Sequence[str]) -> list[str] | None:
    """The overrides of a plain single run (no flag, no sweep, no Hydra launcher plugin), else None."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if any(a.startswith("-") or a.startswith("hydra/launcher=") for a in argv):
        return None
    try:
        args = get_args_parser().parse_args(list(argv))
        if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(args.overrides)):
            return None
    except (SystemExit, HydraException):  # Hydra's app says what is wrong with them, as it always has
        return None
    return list(args.overrides)


def run_once(overrides: list[str]) -> int:
    """A single run, composed once: the composition that checks the overrides is the one the job runs.

    What @hydra.main does for a run, with Hydra's own parts (its logging set-up, callbacks and `run_job`: the run
    directory, `hydra.job.env_set`, the job's log file), minus a second composition of the same config.
    """
    from hydra import initialize_config_module
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log
    from hydra.core.utils import run_job as run_hydra_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict

    from launcher.parent.overrides import CONFIG_MODULE, CONFIG_NAME, compose_checked

    with initialize_config_module(config_module=CONFIG_MODULE, job_name="launch", version_base="1.3"):
        cfg, error = compose_checked(overrides, hydra_node=True)
        if error:
            fail(error)
        assert cfg is not None
        with open_dict(cfg):
            cfg.hydra.mode = RunMode.RUN
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=CONFIG_NAME)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
        ret = run_hydra_job(_task, cfg, job_dir_key="hydra.run.dir", job_subdir_key=None, hydra_context=context)
        callbacks.on_run_end(config=cfg, config_name=CONFIG_NAME, job_return=ret)
        return ret.return_value  # raises what the job raised


def plan(overrides: list[str]) -> int:
    """`launch plan [overrides]`: memory and communication per rank, for the run these overrides describe.

    Composes with the compose API, never through the Hydra app: nothing runs, no output directory is made.
    """
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        fail(f"launch plan takes overrides only, not {flags[0]}; e.g. launch plan model=gpt_7b gpus=8")
    from hydra import initialize_config_module

    from launcher.config import ConfigError
    from launcher.optim.checks import measure
    from launcher.parent.overrides import CONFIG_MODULE, check_overrides
    from launcher.plan.commands import plan_command  # imports torch (never deepspeed or wandb)

    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return plan_command(overrides, measure)  # with the matrices optim=muon gathers
    except ConfigError as e:
        # Overrides that do not compose get the launcher's usual one-line report (checked only now: it composes too).
        fail(check_overrides(overrides) or str(e))
    return 0


EXPORT_KEYS = ("image", "name", "namespace")
"""`launch export kubeflow`'s own keys; every other argument is an override of the run."""


def export(args: Sequence[str]) -> None:
    """launch export kubeflow image=IMAGE [name=NAME] [namespace=NS] overrides: a Kubeflow PyTorchJob manifest (YAML,
    on stdout) that runs this exact config on `nodes` pods of `gpus` workers each. Checked as a run would check its
    config (composition, ranges, the batch contract at that size) before anything is printed."""
    usage = "usage: launch export kubeflow image=IMAGE [name=NAME] [namespace=NS] nodes=N gpus=G [the run's overrides]"
    if args[:1] != ["kubeflow"] or any(a.startswith("-") or "=" not in a for a in args[1:]):
        fail(usage)
    own = {key: [a.split("=", 1)[1] for a in args[1:] if a.startswith(f"{key}=")] for key in EXPORT_KEYS}
    overrides = [a for a in args[1:] if a.split("=", 1)[0] not in EXPORT_KEYS]
    if not own["image"]:
        fail(f"{usage}: image= names the container image that has launch and your code installed")
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from launcher.clusters.kubernetes import pytorchjob
    from launcher.config import ConfigError, derive, freeze
    from launcher.config.identity import identity_hash
    from launcher.parent.overrides import CONFIG_MODULE, compose_checked

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed, error = compose_checked(overrides)
        if error:
            fail(error)
        try:
            frozen = freeze(composed)
            if frozen.gpus is None:
                raise ConfigError("gpus is unset; give gpus=N, the workers (GPUs) of each pod")
            derived = derive(frozen, cuda_devices=frozen.gpus if frozen.device != "cpu" else 0)  # as each pod derives
            if derived.min_nodes < derived.nodes:
                raise ConfigError(
                    f"nodes={frozen.nodes} is an elastic range, but a PyTorchJob has a fixed number of pods; give "
                    f"nodes=N (elastic jobs run on nodes you start by hand: see the README's Runs that adapt)"
                )
            if derived.nodes > 1 and not frozen.trainer.checkpoint_dir:
                raise ConfigError(
                    f"the {derived.nodes} pods share no file system: give trainer.checkpoint_dir=s3://bucket/prefix "
                    "(any fsspec URL), or a folder on a volume you mount in every pod"
                )
        except ConfigError as e:
            fail(str(e))
    name = own["name"][-1] if own["name"] else f"launch-{identity_hash(frozen, composed)[:10]}"
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        fail(
            f"name={name} is not a Kubernetes object name (lower-case letters, digits and '-', at most 63); e.g. "
            f"name={re.sub(r'[^a-z0-9-]+', '-', name.lower()).strip('-')[:63] or 'launch'}"
        )
    job = pytorchjob(
        name, own["image"][-1], derived.nodes, derived.gpus, overrides, derived.device, (own["namespace"] or [None])[-1]
    )
    print(OmegaConf.to_yaml(OmegaConf.create(job)), end="")


def convert(args: Sequence[str]) -> None:
    """launch convert CHECKPOINT out=FILE.safetensors | out=DIR [merge=true] [ema=true] [model overrides]:
    consolidated model weights (ema=true: the EMA weights); a folder's model is the run's (its resolved.yaml), the
    overrides changing what they name."""
    paths = [a for a in args if "=" not in a]
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    merges = [a.split("=", 1)[1] for a in args if a.startswith("merge=")]
    emas = [a.split("=", 1)[1] for a in args if a.startswith("ema=")]
    overrides = [a for a in args if "=" in a and not a.startswith(("out=", "merge=", "ema="))]
    usage = (
        "usage: launch convert CHECKPOINT out=FILE.safetensors, or out=DIR [merge=true] [ema=true] [model overrides "
        "over the run's]"
    )
    if len(paths) != 1 or len(outs) != 1 or len(merges) > 1 or len(emas) > 1 or any(a.startswith("-") for a in args):
        fail(usage)
    if emas and emas[0] not in ("true", "false"):
        fail(f"ema={emas[0]} is not a boolean; use ema=true (the EMA weights) or ema=false")
    if merges and merges[0] not in ("true", "false"):
        fail(f"merge={merges[0]} is not a boolean; use merge=true (a PEFT model's adapters merged) or merge=false")
    merge = merges == ["true"]
    from pathlib import Path

    out = Path(outs[0])
    if out.suffix == ".safetensors" and overrides:
        fail(f"out={out} writes the weights alone; model overrides ({overrides[0]}) are for out=DIR")
    if out.suffix == ".safetensors" and merge:
        fail(f"merge=true writes a model folder; use out=DIR (not out={out})")
    from launcher.checkpoint.format import CheckpointError
    from launcher.config import ConfigError, freeze
    from launcher.parent.convert import convert as write
    from launcher.parent.overrides import CONFIG_MODULE, compose_checked

    try:
        model, run = None, None
        # A folder, or EMA weights (a tied parameter's names): the run's model (its resolved.yaml), overrides over it.
        if out.suffix != ".safetensors" or emas == ["true"]:
            from hydra import initialize_config_module

            from launcher.parent.run_config import MODEL, with_run

            composing, run = with_run(paths[0], overrides, MODEL, "convert")
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                composed, error = compose_checked(composing)
                if error:
                    fail(error)
                model = freeze(composed).model
        written = write(paths[0], out, model, merge, emas == ["true"], run, overrides)  # a local path or a URL
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        fail(str(e).splitlines()[0])
    print(f"launch: wrote {written}")


PREPARE_KEYS = ("out", "data.shard_index", "data.num_shards", "block_size")
"""`launch prepare`'s own keys; every other argument is an override of the data=text config it builds from."""


def prepare(args: Sequence[str]) -> None:
    """launch prepare data=text data.files=... data.tokenizer=... out=URL [data.shard_index=I data.num_shards=N]
    [block_size=4MiB]: a token store for data=store (`launcher.prepare.store`), or part I of N of it."""
    usage = (
        "usage: launch prepare data=text data.files=... data.tokenizer=... out=FOLDER_OR_URL "
        "[data.shard_index=I data.num_shards=N] [block_size=4MiB]"
    )
    if any(a.startswith("-") or "=" not in a for a in args):
        fail(usage)
    own = {key: [a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")] for key in PREPARE_KEYS}
    overrides = [a for a in args if a.split("=", 1)[0] not in PREPARE_KEYS]
    if len(own["out"]) != 1:
        fail(f"{usage}: out= names where the store goes (a local folder, or a URL such as s3://bucket/tokens)")
    from launcher.config import ConfigError

    try:
        part = _part(own["data.shard_index"], own["data.num_shards"])
        from launcher.data.store import parse_bytes

        block = parse_bytes(own["block_size"][-1], "block_size") if own["block_size"] else None
    except ConfigError as e:
        fail(str(e))
    from hydra import initialize_config_module

    from launcher.config import freeze
    from launcher.parent.overrides import CONFIG_MODULE, compose_checked
    from launcher.prepare.store import BLOCK_BYTES, prepare_store

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed, error = compose_checked(overrides)
        if error:
            fail(error)
        try:
            data = freeze(composed).data
            if data._target_ != "launcher.data.text.Text":
                raise ConfigError(
                    f"launch prepare builds a store from data=text (its files and tokenizer), not data={data._target_}"
                    "; give data=text data.files=... data.tokenizer=..."
                )
            print(prepare_store(data, own["out"][0], part, block or BLOCK_BYTES), flush=True)
        except ConfigError as e:
            fail(str(e))


def _part(index: list[str], count: list[str]) -> tuple[int, int] | None:
    """(i, n) of data.shard_index=i data.num_shards=n, or None for the whole build; ConfigError for a bad pair."""
    from launcher.config import ConfigError

    if not index and not count:
        return None
    try:
        i, n = int(index[-1]), int(count[-1])
    except (IndexError, ValueError):
        raise ConfigError(
            "data.shard_index and data.num_shards go together, as integers: e.g. data.shard_index=0 "
            "data.num_shards=4 (a SLURM array: data.shard_index=$SLURM_ARRAY_TASK_ID)"
        ) from None
    if not 0 <= i < n:
        raise ConfigError(f"data.shard_index={i} is not in 0..{n - 1} (data.num_shards={n})")
    return i, n
