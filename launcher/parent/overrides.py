"""The overrides of a launch composed with Hydra's compose API, so that a bad override becomes one clear line instead of
Hydra's multi-line report: a single run runs that composition (`launcher.parent.cli.run_once`); for Hydra's app (sweeps,
flags) it is a precheck, and every job of a sweep is checked as a run would be before the first one starts.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from launcher.base.environ import restore
from launcher.config import SEVERAL, one_line, schema
from launcher.config.known import ELSEWHERE

CONFIG_MODULE = "launcher.conf"
CONFIG_NAME = "config"


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
    """One line for overrides that cannot compose, or for the first job of a sweep that would be refused; else None.
    For Hydra's app (sweeps, flags), which composes them again itself, and for `launch plan`'s message."""
    from hydra import initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed, problem = compose_checked(overrides, hydra_node=True)
        if problem or composed is None:
            return problem
        user = _user_overrides(overrides)
        if not _multirun(OverridesParser.create().parse_overrides(user)):
            return None  # a single run: the launcher checks the rest before it writes anything
        return _check_sweep(user, composed.hydra, overrides)


def _user_overrides(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra")]


def compose_checked(overrides: Sequence[str], hydra_node: bool = False) -> tuple[DictConfig | None, str | None]:
    """The config these overrides compose to (inside a compose context; a sweep at its first value), or one line
    saying why there is none: a choice that does not exist (naming the valid ones), a key that does not (naming its
    neighbours), a value of the wrong type, a run directory that cannot be made.

    `hydra_node=True`: with Hydra's node, the config a single run runs, the user's `hydra.*` overrides applied too (a
    sweep's are Hydra's own to apply, and may not compose as a run). Ranges are not checked here: `config.freeze`
    does, once.
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user = _user_overrides(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(user)
    except HydraException as e:
        return None, one_line(e)
    groups = set(GlobalHydra.instance().config_loader().get_group_options("", results_filter=None))
    first: list[str] = []
    for o in parsed:
        group = o.key_or_group
        candidates = _candidates(o)
        if group in groups and not o.is_delete():
            options = schema.choices()[group]
            for value in candidates:
                if value not in options:
                    return None, f"unknown {group} '{value}'; valid: {', '.join(options)} (e.g. {group}={options[0]})"
        if o.is_sweep_override() and not candidates:
            continue  # a sweep we cannot expand here (interval, glob): Hydra checks it per job
        value = candidates[0] if o.is_sweep_override() else o.get_value_element_as_str()
        first.append(f"{o.get_key_element()}={value}" if not o.is_delete() else o.input_line)
    if hydra_node:
        first += [o for o in overrides if o not in user]
    try:
        composed = compose(CONFIG_NAME, overrides=first, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        return None, _unknown_key(e, first) or one_line(e)
    problem = _run_dir_problem(composed.hydra, overrides, parsed)
    if problem:
        return None, problem
    if not hydra_node:
        with open_dict(composed):
            composed.pop("hydra")
    return composed, None


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
    from launcher.parent.checks import check_job

    saved, hydra_before = {key: os.environ.get(key) for key in env}, HydraConfig.instance().cfg
    os.environ.update({key: str(value) for key, value in env.items()})  # each job runs with hydra.job.env_set
    shown: set[str] = set()
    try:
        for n, job in enumerate(jobs):
            where = " ".join(o for o in job if o.split("=", 1)[0] in swept) or " ".join(job)
            problem, said = None, io.StringIO()
            try:
                cfg = compose(CONFIG_NAME, overrides=job, return_hydra_config=True)
                HydraConfig.instance().set_config(cfg)  # the job's own ${hydra:...} values resolve as in the job
                with open_dict(cfg):
                    cfg.pop("hydra")
                with contextlib.redirect_stdout(said):
                    check_job(cfg)  # ranges (config.freeze) and every check a run makes before it starts
            except (HydraException, OmegaConfBaseException) as e:
                problem = one_line(e)
            except ConfigError as e:
                problem = str(e)
            finally:  # what a single run says at start, once for the sweep: a line its jobs say alike, once
                for line in said.getvalue().splitlines():
                    if line not in shown:
                        shown.add(line)
                        print(line, flush=True)
            if problem:
                return f"sweep job {n + 1} of {len(jobs)} ({where}): {problem}; nothing of the sweep has run"
    finally:
        HydraConfig.instance().cfg = hydra_before
        restore(saved)
    return None


def _run_dir_problem(hydra_node: DictConfig, overrides: Sequence[str], parsed: Sequence[Any]) -> str | None:
    """Hydra makes the run (or sweep) directory before the run starts, with a traceback if it cannot: say it first."""
    import os
    import tempfile
    from pathlib import Path

    key = "hydra.sweep.dir" if _multirun(parsed) else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    try:
        folder = Path(given[-1] if given else str(OmegaConf.select(hydra_node, key.removeprefix("hydra.")))).absolute()
    except Exception:  # an interpolation only Hydra's job can resolve: it checks it itself
        return None
    for _ in range(50):  # the nodes of one job probe one shared folder at once: one may remove it under another
        made = [p for p in (folder, *folder.parents) if not p.exists()]
        try:  # try it for real (root bypasses permission bits; /proc, read-only mounts) and leave nothing behind
            folder.mkdir(parents=True, exist_ok=True)
            handle, probe = tempfile.mkstemp(prefix=".launch-probe-", dir=folder)
            os.close(handle)
            os.unlink(probe)
            return None
        except (FileNotFoundError, FileExistsError) as e:  # made by another launcher, removed by it meanwhile: again
            error = e
        except OSError as e:
            error = e
            break
        finally:
            for created in made:  # deepest first
                try:
                    created.rmdir()
                except OSError:
                    break
    return f"{key}={folder} cannot be created and written ({error.strerror}: {error.filename}); choose another {key}"


def _candidates(o) -> list[str]:
    """The options an override names: its value, each value of a sweep, each element of a list (`logger=[a,b]`)."""
    value = o.value()
    if isinstance(value, list):
        return [str(v) for v in value]
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
    if key in ELSEWHERE and isinstance(node, DictConfig) and leaf not in node:
        return f"unknown key '{key}' for this strategy; {ELSEWHERE[key]}"
    if parent in SEVERAL and isinstance(node, DictConfig) and len(node) and leaf not in node:
        value = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), "...")
        return (
            f"unknown key '{key}'; {where} has: {valid}, each option's settings under its name (e.g. "
            f"{parent}.{next(iter(node))}.{leaf}={value})"
        )
    return f"unknown key '{key}'; {where} has: {valid} (to add a new key use +{key}=...)"
