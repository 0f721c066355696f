"""The `launch` console script: a Hydra app over conf/, with one-line errors for bad input.

This module imports only Hydra and OmegaConf, so `launch --help` and `launch --cfg job`
never pay for torch, deepspeed or wandb; the run itself is imported when a job starts.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher import schema
from launcher.config import EXIT_BAD_INPUT

CONFIG_MODULE = "launcher.conf"
CONFIG_NAME = "config"

schema.register()


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print a one-line error and exit non-zero."""
    print(f"launch: error: {message}", file=sys.stderr)
    raise SystemExit(code)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _app(cfg: DictConfig) -> dict[str, Any] | None:
    from launcher.launch import run_job  # imports torch: only once a job really starts

    code = run_job(cfg)
    if isinstance(code, dict):  # a search's trial: its outcome and objective, for the sweeper
        return code
    if code:
        raise SystemExit(code)


def console() -> None:
    """The `launch` console script: `main`, then an exit that skips the interpreter's teardown (`exit_now`)."""
    from launcher.lifecycle import exit_now

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
    if argv[:1] == ["convert"]:
        return convert(argv[1:])
    if argv[:1] == ["plan"]:
        raise SystemExit(plan(argv[1:]))
    error = precheck(argv)
    if error:
        fail(error)
    from launcher.clusters import submission

    try:
        argv += submission(argv)  # a submission to a cluster (hydra/launcher=submitit_slurm): the run's shape
    except ValueError as e:
        fail(str(e))
    sys.argv = [sys.argv[0], *argv]
    _app()


def plan(overrides: list[str]) -> int:
    """`launch plan [overrides]`: memory and communication per rank, for the run these overrides describe.

    Composes with the compose API, never through the Hydra app: nothing runs, no output directory is made.
    """
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        fail(f"launch plan takes overrides only, not {flags[0]}; e.g. launch plan model=gpt_7b gpus=8")
    from hydra import initialize_config_module

    from launcher.config import ConfigError
    from launcher.plan.commands import plan_command  # imports torch (never deepspeed or wandb)

    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return plan_command(overrides)
    except ConfigError as e:
        # Overrides that do not compose get the launcher's usual one-line report (checked only now: it composes too).
        fail(check_overrides(overrides) or str(e))
    return 0


def convert(args: Sequence[str]) -> None:
    """launch convert CHECKPOINT out=FILE.safetensors | out=DIR [merge=true] [model overrides]: consolidated model
    weights."""
    paths = [a for a in args if "=" not in a]
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    merges = [a.split("=", 1)[1] for a in args if a.startswith("merge=")]
    overrides = [a for a in args if "=" in a and not a.startswith(("out=", "merge="))]
    usage = "usage: launch convert CHECKPOINT out=FILE.safetensors, or out=DIR [merge=true] [the run's model overrides]"
    if len(paths) != 1 or len(outs) != 1 or len(merges) > 1 or any(a.startswith("-") for a in args):
        fail(usage)
    if merges and merges[0] not in ("true", "false"):
        fail(f"merge={merges[0]} is not a boolean; use merge=true (a PEFT model's adapters merged) or merge=false")
    merge = merges == ["true"]
    from pathlib import Path

    out = Path(outs[0])
    if out.suffix == ".safetensors" and overrides:
        fail(f"out={out} writes the weights alone; model overrides ({overrides[0]}) are for out=DIR")
    if out.suffix == ".safetensors" and merge:
        fail(f"merge=true writes a model folder; use out=DIR (not out={out}) with the run's model overrides")
    from launcher.checkpoint.format import CheckpointError
    from launcher.config import ConfigError, freeze
    from launcher.convert import convert as write

    try:
        model = None
        if out.suffix != ".safetensors":  # a folder: the model of these overrides, as `launch` would build it
            from hydra import compose, initialize_config_module

            error = check_overrides(overrides)
            if error:
                fail(error)
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                model = freeze(compose(CONFIG_NAME, overrides=overrides)).model
        written = write(Path(paths[0]), out, model, merge)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        fail(str(e).splitlines()[0])
    print(f"launch: wrote {written}")


# --------------------------------------------------------------------------------------------
# Precheck: compose once with the compose API, so that a bad override becomes one clear line
# instead of Hydra's multi-line report. Sweeps are checked value by value for group choices.
# --------------------------------------------------------------------------------------------


def precheck(argv: Sequence[str]) -> str | None:
    """Return a one-line error for overrides that cannot compose, or None."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(list(argv))
    except SystemExit:
        return None  # argparse already printed its own usage error; let Hydra handle the rest
    if (
        args.help
        or args.hydra_help
        or args.shell_completion
        or args.info
        or args.experimental_rerun
        or args.config_dir
        or args.config_path
        or args.config_name
    ):
        return None
    return check_overrides(args.overrides)


def check_overrides(overrides: Sequence[str]) -> str | None:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(user)
    except HydraException as e:
        return _one_line(e)
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.get_group_options("", results_filter=None))
        first: list[str] = []
        for o in parsed:
            group = o.key_or_group
            candidates = _candidates(o)
            if group in groups and not o.is_delete():
                options = schema.choices()[group]
                for value in candidates:
                    if value not in options:
                        return f"unknown {group} '{value}'; valid: {', '.join(options)} (e.g. {group}={options[0]})"
            if o.is_sweep_override() and not candidates:
                continue  # a sweep we cannot expand here (interval, glob): Hydra checks it per job
            value = candidates[0] if o.is_sweep_override() else o.get_value_element_as_str()
            first.append(f"{o.get_key_element()}={value}" if not o.is_delete() else o.input_line)
        try:
            composed = compose(CONFIG_NAME, overrides=first, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as e:
            return _unknown_key(e, first) or _one_line(e)
        with open_dict(composed):
            hydra_node = composed.pop("hydra")
        problem = schema.check_ranges(composed) or _run_dir_problem(hydra_node, overrides, parsed)
        if problem or not _multirun(parsed):
            return problem  # a single run: the launcher checks the rest before it writes anything
        return _check_sweep(user, hydra_node, overrides)
    return None


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _multirun(parsed: Sequence[Any]) -> bool:
    return any(o.is_sweep_override() for o in parsed) or "--multirun" in sys.argv or "-m" in sys.argv


def _check_sweep(user: list[str], hydra_node: DictConfig, overrides: Sequence[str]) -> str | None:
    """Every job of a sweep whose jobs are known in advance (Hydra's basic sweeper: every combination), checked as a
    single run would be, before the first one starts and before Hydra writes anything. Sweepers that choose values
    as they go (Optuna) have their jobs checked one by one, as each starts."""
    from hydra import compose
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from launcher.config import ConfigError

    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra/sweeper=")]
    if OmegaConf.select(hydra_node, "sweeper._target_") != BASIC_SWEEPER or chosen[-1:] not in ([], ["basic"]):
        return None
    params, env_set = hydra_node.sweeper.get("params"), OmegaConf.select(hydra_node, "job.env_set")
    try:  # quietly: the job's own resolution says what it has to say (the smoke sweep's strategies left out)
        with contextlib.redirect_stderr(io.StringIO()):
            plain = OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else {}
            env = OmegaConf.to_container(env_set, resolve=True) if isinstance(env_set, DictConfig) else {}
    except OmegaConfBaseException:  # values only Hydra's job can resolve: each job is checked as it starts
        return None
    given = [f"{key}={value}" for key, value in plain.items()] + user  # the basic sweeper's order: yours win
    try:
        (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(given), None)
    except HydraException:  # a sweep the basic sweeper cannot list (an interval): Hydra says so itself
        return None
    swept = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in other for other in jobs) < len(jobs)}
    from launcher.launch import check_job  # imports torch: only for a sweep

    saved, hydra_before = {key: os.environ.get(key) for key in env}, HydraConfig.instance().cfg
    os.environ.update({key: str(value) for key, value in env.items()})  # each job runs with hydra.job.env_set
    try:
        for n, job in enumerate(jobs):
            where = " ".join(o for o in job if o.split("=", 1)[0] in swept) or " ".join(job)
            try:
                cfg = compose(CONFIG_NAME, overrides=job, return_hydra_config=True)
                HydraConfig.instance().set_config(cfg)  # the job's own ${hydra:...} values resolve as in the job
                with open_dict(cfg):
                    cfg.pop("hydra")
                problem = schema.check_ranges(cfg)
                if problem is None:
                    check_job(cfg)
            except (HydraException, OmegaConfBaseException) as e:
                problem = _one_line(e)
            except ConfigError as e:
                problem = str(e)
            if problem:
                return f"sweep job {n + 1} of {len(jobs)} ({where}): {problem}; nothing of the sweep has run"
    finally:
        HydraConfig.instance().cfg = hydra_before
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return None


def _run_dir_problem(hydra_node: DictConfig, overrides: Sequence[str], parsed: Sequence[Any]) -> str | None:
    """Hydra makes the run (or sweep) directory before the run starts, with a traceback if it cannot: say it first."""
    import os
    from pathlib import Path

    key = "hydra.sweep.dir" if _multirun(parsed) else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    try:
        folder = Path(given[-1] if given else str(OmegaConf.select(hydra_node, key.removeprefix("hydra.")))).absolute()
    except Exception:  # an interpolation only Hydra's job can resolve: it checks it itself
        return None
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:  # try it for real (root bypasses permission bits; /proc, read-only mounts) and leave nothing behind
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".launch-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"{key}={folder} cannot be created and written ({e.strerror}: {e.filename}); choose another {key}"
    finally:
        for created in made:  # deepest first
            try:
                created.rmdir()
            except OSError:
                break
    return None


def _candidates(o) -> list[str]:
    if not o.is_sweep_override():
        return [o.get_value_element_as_str()]
    try:
        return [str(v) for v in o.sweep_string_iterator()]
    except Exception:  # interval and glob sweeps have no finite list without the options
        return []


def _unknown_key(e: Exception, overrides: list[str]) -> str | None:
    from hydra import compose

    match = re.search(r"Could not override '([^']+)'", str(e))
    if not match:
        return None
    key = match.group(1)
    parent, _, leaf = key.rpartition(".")
    try:
        base = compose(CONFIG_NAME, overrides=[o for o in overrides if not o.startswith(f"{key}=")])
    except Exception:  # another override fails too: name the first one without the list of keys
        return f"unknown key '{key}' (to add a new key use +{key}=...)"
    node = OmegaConf.select(base, parent) if parent else base
    valid = ", ".join(sorted(node.keys())) if isinstance(node, DictConfig) else "?"
    where = parent or "the top level"
    return f"unknown key '{key}'; {where} has: {valid} (to add a new key use +{key}=...)"


def _one_line(e: BaseException) -> str:
    parts: list[str] = []
    while e is not None:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        for line in lines:
            if line.startswith(("object_type", "reference_type")) or line in parts:
                continue
            parts.append(line)
        e = e.__cause__  # type: ignore[assignment]
    return "; ".join(parts[:3]) or "invalid configuration"
