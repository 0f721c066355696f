"""`launch eval CHECKPOINT`'s command line: the run's own config taken from beside its checkpoint, the command's
overrides on top, checked against the checkpoint (its model fits, it holds EMA weights where ema=true) before any
worker starts. The evaluation itself is `launcher.evaluation`."""

from __future__ import annotations

from launcher.base.errors import ConfigError


def eval_overrides(args: list[str]) -> list[str]:
    """`launch eval CHECKPOINT [ema=true] [the run's overrides]` as a run's overrides: the checkpoint resumed and
    evaluated once (ema=true: on its EMA weights, which it must hold). ConfigError: a bad command line, in one line."""
    checkpoints = [a for a in args if "=" not in a]
    emas = [a.split("=", 1)[1] for a in args if a.startswith("ema=")]
    if len(checkpoints) != 1 or len(emas) > 1 or any(a.startswith("-") for a in args):
        raise ConfigError(
            "usage: launch eval CHECKPOINT [ema=true] [the run's overrides] "
            "(a checkpoint folder, a run directory or a URL)"
        )
    if emas and emas[0] not in ("true", "false"):
        raise ConfigError(f"ema={emas[0]} is not a boolean; use ema=true (the EMA weights) or ema=false")
    ema = emas == ["true"]
    if ema:
        _check_holds_ema(checkpoints[0])
    from launcher.parent.run_config import TAKEN, with_run

    command = [a for a in args if "=" in a and not a.startswith("ema=")]
    overrides, run = with_run(checkpoints[0], command, TAKEN, "eval")
    _check_fits(checkpoints[0], overrides, run, command)
    return [*overrides, f"resume={checkpoints[0]}", "trainer.eval_only=true", *(["trainer.eval_ema=true"] * ema)]


def _check_fits(path: str, overrides: list[str], run: dict | None, command: list[str]) -> None:
    """The checkpoint against the model these overrides make (on the meta device): a mismatch is one line naming the
    command's setting that differs from the run's, before anything is written (the resume's own check comes later,
    with no run to compare with)."""
    from hydra import initialize_config_module

    from launcher.base.storage import location
    from launcher.checkpoint.format import CheckpointError, find_checkpoint
    from launcher.config import freeze
    from launcher.parent.overrides import CONFIG_MODULE, compose_checked
    from launcher.parent.run_config import check_model

    try:
        checkpoint = find_checkpoint(location(path))
    except (CheckpointError, OSError):
        return  # the resume's own check says why, in one line
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed, error = compose_checked(overrides)
    if error or composed is None:
        raise ConfigError(error or "the overrides do not compose")
    try:
        check_model(checkpoint, freeze(composed).model, run, command)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e


def _check_holds_ema(path: str) -> None:
    """A checkpoint saved without trainer.ema holds no average: refused, not its weights evaluated under its name."""
    from launcher.base.storage import location
    from launcher.checkpoint.format import find_checkpoint
    from launcher.checkpoint.untrusted import read_metadata

    try:
        checkpoint = find_checkpoint(location(path))
        stored = read_metadata(checkpoint).state_dict_metadata
    except Exception:  # not a checkpoint that reads here: the resume's own check says why, in one line
        return
    if not any(key.startswith("ema.") for key in stored):
        raise ConfigError(
            f"ema=true: checkpoint {checkpoint} holds no EMA weights (its run had no trainer.ema.decay); "
            "evaluate it without ema=true"
        )
