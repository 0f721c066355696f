"""The run's own config for `launch eval CHECKPOINT` and `launch convert CHECKPOINT out=DIR`: read from the run's
`resolved.yaml` beside its checkpoints, so that the user does not repeat the run's overrides.

The file is read as data (`yaml.safe_load`: plain mappings, lists, strings and numbers; no interpolation, which could
read the environment). What it gives becomes overrides placed before the command line's: the run's group choices
(`model=gpt_tiny`) and its values (`++model.n_layer=2`), for the settings a checkpoint's figures depend on whatever
the strategy and world size (`TAKEN`). The command line's overrides change only what they name: a key it names (or
one above or below it) is left out of the run's, and a group it chooses (`model=gpt_small`) leaves out the run's whole
node. Where, how many and how the evaluation runs (strategy, gpus, nodes, device, logger) stay the command's.

A config is code where it names what to import (`_target_`, a metric's `inputs`): the file may repeat what this
command's own composition names at the same key (the package's groups, the command line) or a `_target_` of the
package's own model, data and optimizer options (a mixture's sources), never add code of its own. Code the run named
elsewhere (`model=custom model._target_=my_pkg.Net`) is refused in one line that gives the overrides to repeat.
A checkpoint that does not fit the model asked for is one line naming the command's key that differs from the run's
(`check_model`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from launcher.base.errors import ConfigError
from launcher.base.storage import Location

RESOLVED = "resolved.yaml"
TAKEN = (
    "model",
    "data",
    "optim",
    "batch",
    "seed",
    "precision",
    "trainer.metrics",
    "trainer.loss",
    "trainer.eval_batches",
    "trainer.ema",
)
"""What `launch eval` takes from the run: its model, data and optimizer (whose state a checkpoint holds), and the
strategy-independent settings of its figures."""
MODEL = ("model",)
"""What `launch convert` takes: the model."""
GROUPS = ("model", "data", "optim")
"""Config groups among them, chosen by name (the run's `job.choices`)."""
CODE_KEYS = ("_target_", "inputs")
"""Keys whose value names code to import (a metric's `inputs` is a function)."""
MOVED = {
    "launcher.worker.muon.MuonAdamW": "launcher.optim.muon.MuonAdamW",
    "launcher.worker.logs.WandbLogger": "launcher.loggers.wandb.WandbLogger",
    "launcher.worker.mlflow_logger.MlflowLogger": "launcher.loggers.mlflow.MlflowLogger",
    "launcher.worker.tensorboard_logger.TensorBoardLogger": "launcher.loggers.tensorboard.TensorBoardLogger",
    "strategies.fsdp.FSDP": "strategies.sharded.fsdp",
    "launcher.parent.report.SweepReport": "launcher.search.report.SweepReport",
    "launcher.data.mix.Mix": "launcher.mixture.mix.Mix",  # FSDP, or its pipeline form where strategy.pp_size > 1
}
"""The launcher's own `_target_`s that moved to the rooms of their concern (the CHANGELOG lists them): a run written
before names the old path in its resolved.yaml, read as the new one."""
_KEY = re.compile(r"[A-Za-z_][\w\-]*")
_WORD = re.compile(r"[A-Za-z_][\w.\-]*")
MAX_BYTES = 1 << 20


def resolved_of(checkpoint: Location) -> Location | None:
    """The run's resolved.yaml beside a checkpoint (`<run>/checkpoints/step_N`), or None where there is none (its
    checkpoints were written to trainer.checkpoint_dir elsewhere). `with_run` takes it only where its config hash is
    the one the checkpoint's manifest records."""
    for folder in (checkpoint.parent.parent, checkpoint.parent, checkpoint):
        if (folder / RESOLVED).exists():
            return folder / RESOLVED
    return None


def read_run(path: Location) -> dict[str, Any]:
    """The run's resolved.yaml as plain data; ConfigError (one line) where it is not a run's config."""
    import yaml

    try:
        text = path.read_bytes()
        if len(text) > MAX_BYTES:
            raise ValueError(f"{len(text):,} bytes, more than a run's config")
        run = yaml.safe_load(text)
    except Exception as e:  # unreadable, not YAML, or YAML that names a Python object (safe_load refuses it)
        raise ConfigError(f"{path} does not read as a run's config ({type(e).__name__}: {_short(e)})") from e
    if not isinstance(run, dict) or not isinstance((run.get("job") or {}).get("choices", {}), dict):
        raise ConfigError(f"{path} is not a run's config (no mapping of settings and job.choices)")
    return _moved(run)


def _moved(node: Any) -> Any:
    """`node` with each of the launcher's own `_target_`s that moved (`MOVED`) at its new path."""
    if isinstance(node, dict):
        return {k: MOVED.get(v, v) if k == "_target_" else _moved(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved(v) for v in node]
    return node


def run_overrides(run: dict[str, Any], command: Sequence[str], keys: Sequence[str]) -> list[str]:
    """The run's group choices and values under `keys`, as overrides to put before the command line's, leaving out
    what the command names; ConfigError for a value no override can carry (an interpolation, an odd key)."""
    named = _named(command)
    choices = run.get("job", {}).get("choices", {})
    out = []
    for key in keys:
        if key in named["groups"]:
            continue  # the command chose another: the run's node is not this one
        if key in GROUPS and key in choices:
            out.append(f"{key}={_choice(key, choices[key])}")
        found, value = _select(run, key)
        if not found:
            continue
        for leaf, item in _leaves(key, value):
            if not any(_related(leaf, n) for n in named["keys"]):
                out.append(f"++{leaf}={render(item, leaf)}")
    return out


def _choice(group: str, option: Any) -> str:
    """The run's choice of a group, if it is one of the package's options; ConfigError (one line) where not."""
    from launcher.config.groups import choices

    known = choices().get(group, [])
    if option not in known:
        shown = f"{group}={str(option)[:80]}"
        raise ConfigError(
            f"the run's config chose {shown}, which is no {group} option here (its options: {', '.join(known)}); "
            f"give {group}=... on the command line"
        )
    return str(option)


def _named(command: Sequence[str]) -> dict[str, set[str]]:
    """The keys the command line's overrides name, and the groups it chooses (`model=...`)."""
    parsed = _parsed(command)
    keys = {o.key_or_group for o in parsed}
    return {"keys": keys, "groups": {o.key_or_group for o in parsed if o.key_or_group in GROUPS}}


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def _select(tree: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf under `key`: a mapping's entries one by one (an empty one whole), a list
    whole."""
    if not isinstance(value, dict) or not value:
        return [(key, value)]
    out = []
    for k, v in value.items():
        if not isinstance(k, str) or not _KEY.fullmatch(k):
            raise ConfigError(f"the run's config holds a key {k!r} under {key} that no override can name")
        out += _leaves(f"{key}.{k}", v)
    return out


def render(value: Any, key: str = "") -> str:
    """A plain value in Hydra's override syntax (strings quoted); ConfigError for an interpolation (`${...}`), which
    would be resolved, not kept (a resolved config holds none)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if "${" in value:
            raise ConfigError(
                f"the run's config holds an interpolation at {key} ({value[:80]}); a run's resolved.yaml holds none: "
                "give that setting on the command line"
            )
        if _WORD.fullmatch(value) and value.lower() not in ("true", "false", "null", "inf", "nan"):
            return value  # a name (cosine, my_pkg.Net): as it reads
        text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # backslashes count before a quote only
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"
    if isinstance(value, list):
        return "[" + ", ".join(render(v, key) for v in value) + "]"
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str) or not _KEY.fullmatch(k):
                raise ConfigError(f"the run's config holds a key {k!r} under {key} that no override can name")
        return "{" + ", ".join(f"{k}: {render(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    raise ConfigError(f"the run's config holds {type(value).__name__} at {key}, not plain data")


def names_code(key: str, value: Any) -> bool:
    """Whether a leaf names code: a `_target_` or a metric's `inputs`, or a list or mapping that holds one."""
    if key.rsplit(".", 1)[-1] in CODE_KEYS and value is not None:
        return True
    if isinstance(value, dict):
        return any(names_code(f"{key}.{k}", v) for k, v in value.items())
    if isinstance(value, list):
        return any(names_code(key, v) for v in value if isinstance(v, (dict, list)))
    return False


def check_code(taken: Sequence[str], base: Any, path: Location, own: Any = None) -> None:
    """ConfigError (one line, the overrides to give) where the run's overrides `taken` name code that `base` (the
    command's own composition: the package's groups and the command line) does not name at the same key, and that is
    no `_target_` of the package's own options (`own()`: `package_targets`)."""
    from omegaconf import OmegaConf

    foreign = []
    for override in _parsed(taken):
        key, value = override.key_or_group, override.value()
        if not override.is_force_add() or not names_code(key, value):
            continue
        try:
            there = OmegaConf.select(base, key, throw_on_missing=True)
            there = OmegaConf.to_container(there, resolve=True) if OmegaConf.is_config(there) else there
        except Exception:  # missing (???) or not there
            there = None
        packaged = key.endswith("._target_") and own is not None and value in own()
        if there != value and not packaged:
            above, _, last = key.rpartition(".")
            node = OmegaConf.select(base, above) if above else base
            plus = "" if OmegaConf.is_dict(node) and last in node.keys() else "+"  # a key its schema has (even unset)
            foreign.append(f"{plus}{key}={render(value, key)}")
    if foreign:
        raise ConfigError(
            f"the run's config ({path}) names code that is not taken from a file: give {' '.join(foreign)} on the "
            "command line (its other settings come from the run)"
        )


def with_run(checkpoint: str, command: list[str], keys: Sequence[str], what: str) -> tuple[list[str], Any]:
    """The overrides of `launch eval`/`launch convert`: the run's (`run_overrides`, the code they name checked) before
    the command line's, and the run's config (None where its checkpoint has no resolved.yaml beside it: the command
    line's alone, said in one line). ConfigError: one line."""
    from launcher.base.storage import location
    from launcher.checkpoint.format import CheckpointError, find_checkpoint, read_manifest

    try:
        found = find_checkpoint(location(checkpoint))
    except (CheckpointError, OSError):
        return command, None  # the command's own check says why, in one line
    path = resolved_of(found)
    if path is None:
        alone = "the model and data are this command's overrides alone (give the run's)"
        print(f"launch: {what}: no {RESOLVED} beside {found}: {alone}", flush=True)
        return command, None
    run = read_run(path)
    theirs, ours = read_manifest(found).get("config_hash"), (run.get("job") or {}).get("config_hash")
    if theirs != ours:  # a folder above checkpoints written elsewhere: another run's config, not this checkpoint's
        alone = "the model and data are this command's overrides alone (give the run's)"
        other = f"{path} is another run's config (config hash {str(ours)[:16]}, the checkpoint's {str(theirs)[:16]})"
        print(f"launch: {what}: {other}: {alone}", flush=True)
        return command, None
    taken = run_overrides(run, command, keys)
    base = _compose([o for o in taken if not o.startswith("++")] + command)
    check_code(taken, base, path, package_targets)
    choices = ", ".join(o for o in taken if not o.startswith("++"))
    said = f"the run's config from {path} ({choices or 'its values'}); the command line changes what it names"
    print(f"launch: {what}: {said}", flush=True)
    return taken + command, run


@functools.cache
def package_targets() -> frozenset[str]:
    """The `_target_` of every option of the package's model, data and optimizer groups (the launcher's own models
    and data, torch's optimizers): code the launcher's own configs name, which a run's file may repeat anywhere."""
    from hydra import compose, initialize_config_module

    from launcher.config.groups import choices
    from launcher.parent.overrides import CONFIG_MODULE

    found = set()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        for group in GROUPS:
            for option in choices().get(group, []):
                try:
                    target = compose(config_name="config", overrides=[f"{group}={option}"])[group].get("_target_")
                except Exception:  # an option that needs keys of its own (custom: ???)
                    continue
                if isinstance(target, str):
                    found.add(target)
    return frozenset(found)


def _compose(overrides: list[str]) -> Any:
    from hydra import initialize_config_module

    from launcher.parent.overrides import CONFIG_MODULE, compose_checked

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed, error = compose_checked(overrides)
    if error or composed is None:
        raise ConfigError(error or "the overrides do not compose")
    return composed


def check_model(checkpoint: Location, model_cfg: Any, run: dict[str, Any] | None, command: Sequence[str]) -> None:
    """The model of `model_cfg`, built on the meta device, against the checkpoint's tensors: CheckpointError (one
    line) on a mismatch, naming the command's model settings that differ from the run's, or the fix."""
    from launcher.checkpoint.format import CheckpointError
    from launcher.checkpoint.loading import check_fits
    from launcher.models.meta import build_on_meta

    try:
        check_fits(checkpoint, build_on_meta(model_cfg))
    except CheckpointError as e:
        message = str(e).splitlines()[0].split("; resume with")[0]
        raise CheckpointError(f"{message}; {fit_fix(run, command)}") from e


def fit_fix(run: dict[str, Any] | None, command: Sequence[str]) -> str:
    """How to make a checkpoint fit the model asked for: leave out the command's model (or data) settings that
    differ from the run's, or give the run's."""
    if run is None:
        return "give the model overrides the run was launched with"
    differ = []
    for override in _parsed(command):
        key = override.key_or_group
        if not key.startswith(("model", "data")) or override.is_delete():
            continue
        found, value = _select(run, key) if key not in GROUPS else (True, run["job"]["choices"].get(key))
        if found and value != override.value():
            differ.append(f"{key}={override.value()} (the run's: {value})")
    if differ:
        return f"leave out {', '.join(differ)}: the run's config makes the model its checkpoint holds"
    return "the run's own config does not build it either: the model's code or its defaults changed since"


def _parsed(command: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return list(OverridesParser.create().parse_overrides(list(command)))


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]
