"""Metric loggers and the progress line. Only rank 0 logs; other ranks get NullLogger.

A logger is any `_target_` with `log(metrics, step)` and `finish()` (or `finish(status)`, to hear how the run ended:
FINISHED, FAILED or KILLED, a stop signal); it is constructed with its own config keys plus `run_config` (the resolved
run config as a dict) and `run_dir`. `run_config["job"]["run_id"]` is the job's one run id, kept across restarts,
requeues and `resume=` of its run directory, and `run_config["job"]["continues"]` the run a `resume=` into a new run
directory continues (`launcher.parent.run_id`); `last_logged_step(run_dir / "metrics.jsonl")` is where an earlier
attempt of the run stopped logging. Several loggers at once (`logger=[wandb,mlflow]`): each gets every figure at every
step metrics.jsonl gets, in the order they are named.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.base.settings import Settings


class NullLogger:
    def __init__(self, **_: Any) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class JsonlLogger:
    """metrics.jsonl in the run directory: always written by rank 0, read by tests and sweep reports."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Strict JSON: a NaN or Inf figure is null (json.dumps would write the bare NaN that strict readers refuse).
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **record}, allow_nan=False) + "\n")

    def finish(self) -> None:
        self.file.close()


def last_logged_step(path: Path) -> int:
    """The highest step metrics.jsonl at `path` holds (0: none), for a logger that must not log a step twice.

    Each attempt of a run appends from the step it resumed at, so the file is increasing stretches, one per attempt,
    and its highest step need not be its last (an attempt killed before it passed the one before): the whole file is
    read once, when the logger starts (about a second a million steps). A torn last line (a kill mid-write) is
    skipped: that step reached no logger, which are written after metrics.jsonl (`Loggers.log`)."""
    highest = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b'{"step": ') and line.endswith(b"\n"):
                    step = line[len(b'{"step": ') :].split(b",", 1)[0]
                    if step.isdigit():
                        highest = max(highest, int(step))
    except FileNotFoundError:
        pass
    return highest


def installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (a logger's check: its package is heavy)."""
    from importlib.util import find_spec

    try:
        return find_spec(package) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module left without a spec
        return False


def can_make(folder: Path) -> bool:
    """Whether this user can make `folder` or write in it: its nearest existing parent is a folder it can write."""
    path = folder.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _wandb_mode(mode: str | None) -> str:
    """logger.wandb.mode, else WANDB_MODE, else online with an API key and offline without one."""
    return mode or os.environ.get("WANDB_MODE") or ("online" if _has_api_key() else "offline")


WANDB_REACH_TIMEOUT = 5.0
"""Seconds the launcher waits for wandb's server before it says it cannot be reached (wandb itself would hang for
minutes in a worker)."""


def _reach_wandb() -> None:
    """ConnectionError (one line naming WANDB_MODE=offline) when wandb's server does not answer within
    WANDB_REACH_TIMEOUT seconds; any HTTP answer, even an error status, means it can be reached."""
    import urllib.error
    import urllib.request

    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        urllib.request.urlopen(url, timeout=WANDB_REACH_TIMEOUT).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as e:  # URLError, a refused connection, a timeout, a malformed URL
        reason = getattr(e, "reason", None) or e
        raise ConnectionError(
            f"logger=wandb runs online but {url} cannot be reached ({reason}); log offline with WANDB_MODE=offline "
            "(upload later with wandb sync), or use logger=none"
        ) from e


FINISH_GRACE = 3.0
"""Seconds a failing rank 0 gives its loggers to finish (`finish_failed`) before it exits anyway."""
_OPEN: list[Loggers] = []
"""This process's loggers not finished yet."""


def finish_failed() -> None:
    """A failing rank 0, just before it exits (`launcher.worker.lifecycle.report_failure`): its loggers finish as
    FAILED, so what the attempt logged reaches them (offline, wandb writes its file 32 KiB at a time: a short attempt's
    whole history) and the next attempt resumes a run that says it failed. In a thread, for at most `FINISH_GRACE`
    seconds: a logger that hangs (its server gone) does not hold the failure up."""
    import threading

    def finish() -> None:
        for loggers in list(_OPEN):
            try:
                loggers.finish("FAILED")
            except Exception:  # the run is lost either way; the failure being reported is what matters
                pass

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    thread.join(FINISH_GRACE)


def check_loggers(frozen: Any) -> None:
    """Before any worker starts, in the launcher: each logger's own `check` of its settings, where it has one (the
    built-in ones do: their package installed, their values, their server or folder reachable), without starting a
    run. ConfigError (one line)."""
    from omegaconf import OmegaConf

    from launcher.base.errors import ConfigError, failure
    from launcher.base.targets import locate
    from launcher.config import target_nodes

    for path, node in target_nodes(frozen, "logger"):
        check = getattr(locate(str(node._target_)), "check", None)
        if not callable(check):
            continue
        settings = {k: v for k, v in OmegaConf.to_container(node).items() if not str(k).startswith("_")}
        try:
            check(**settings)
        except (ConnectionError, ImportError) as e:  # its package, its service: the message says what to do
            raise ConfigError(str(e)) from e
        except (TypeError, ValueError) as e:
            raise failure("logger", e, f"fix the {path}.* values") from e


def finish(logger: Any, status: str) -> None:
    """`logger.finish(status)` where its finish takes a status, else `logger.finish()` (a logger of the plain
    contract)."""
    import inspect

    try:
        parameters = inspect.signature(logger.finish).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the plain contract
        parameters = []  # type: ignore[assignment]
    if any(p.name == "status" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters):
        logger.finish(status)
    else:
        logger.finish()


WANDB_MODES = ("online", "offline", "disabled")
WANDB_FORBIDDEN = set("/\\#?%:")
"""Characters wandb refuses in project and entity names."""


class WandbLogger:
    """Weights & Biases. Without an API key (and no explicit mode) it logs offline, never blocking on the network."""

    @staticmethod
    def check(**keys: Any) -> None:
        """The settings wandb would refuse once a run starts, checked without importing wandb: ValueError (one line).
        `keys`: logger.wandb's (launcher/config/schema.py: `WandbConfig`, their one place)."""
        wandb = Settings(**keys)
        if wandb.mode is not None and wandb.mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode={wandb.mode} is not one of {', '.join(WANDB_MODES)} (or unset)")
        for key in ("project", "entity"):
            value = getattr(wandb, key)
            if value is not None and (not str(value) or WANDB_FORBIDDEN & set(str(value)) or len(str(value)) > 128):
                raise ValueError(
                    f"logger.wandb.{key}={value!r} is not a valid wandb {key} name (1-128 characters, none of /\\#?%:)"
                )
        for tag in wandb.tags or []:
            if not 0 < len(str(tag)) <= 64:
                raise ValueError(f"logger.wandb.tags holds {tag!r}: wandb tags are 1 to 64 characters")
        if _wandb_mode(wandb.mode) == "online":
            _reach_wandb()

    def __init__(self, run_config: dict[str, Any], run_dir: str, **keys: Any) -> None:
        """`keys`: logger.wandb's (launcher/config/schema.py: `WandbConfig`)."""
        import wandb  # heavy: only rank 0 of a run that asked for wandb pays for it

        settings = Settings(**keys)
        mode = _wandb_mode(settings.mode)
        job = run_config.get("job") or {}
        run_id, continues = job.get("run_id"), job.get("continues")  # `launcher.parent.run_id`: one wandb run per job
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            name=settings.name or Path(run_dir).name,
            tags=list(settings.tags or []),
            notes=f"continues wandb run {continues}" if continues else None,  # and job.continues in its config
            mode=mode,
            dir=run_dir,
            config=run_config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(silent=True),
        )
        self.offline = mode == "offline"
        # One step axis: the steps an earlier attempt of this run logged (it went past the checkpoint this one
        # resumed from) are not logged again; wandb would drop them, and offline runs would hold them twice.
        self.logged = last_logged_step(Path(run_dir) / "metrics.jsonl") if run_id else 0
        self.said = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.logged:
            if not self.said:
                self.said = True
                steps = f"step {step} is" if step == self.logged else f"steps {step}..{self.logged} are"
                print(
                    f"wandb: {steps} in run {self.run.id} already (an earlier attempt logged them): logging from "
                    f"step {self.logged + 1} on",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.run.log(metrics, step=step)

    def finish(self, status: str = "FINISHED") -> None:
        run_dir = getattr(self.run, "dir", None)
        self.run.finish(exit_code=1 if status == "FAILED" else 0)  # wandb: failed, or finished (a stop resumes later)
        if self.offline and run_dir:
            folder = Path(run_dir).parent
            print(f"wandb: logged offline to {folder}; upload with: wandb sync {folder}", file=sys.stderr)


HIDDEN = "<hidden>"
"""What the loggers get in place of a secret of the run config (`rdzv.secret`)."""


def run_config(cfg: Any) -> dict[str, Any]:
    """The resolved run config as the loggers get it (a dict): rdzv.secret, the token that guards the rendezvous of a
    job submitted to SLURM, hidden."""
    from omegaconf import OmegaConf

    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    if isinstance(config.get("rdzv"), dict) and config["rdzv"].get("secret"):
        config["rdzv"]["secret"] = HIDDEN
    return config


@dataclass(eq=False)
class Loggers:
    """Rank 0 writes metrics.jsonl and every configured logger; the other ranks write nothing."""

    rank: int
    jsonl: Any
    external: list[Any] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: Any, rank: int, run_dir: Path) -> Loggers:
        from hydra.utils import instantiate

        from launcher.config import target_nodes

        if rank != 0:
            return cls(rank, NullLogger())
        config = run_config(cfg)
        loggers = cls(rank, JsonlLogger(run_dir / "metrics.jsonl"))
        _OPEN.append(loggers)
        try:
            for _, node in target_nodes(cfg, "logger"):
                built = instantiate(node, _partial_=True, _convert_="all")(run_config=config, run_dir=str(run_dir))
                loggers.external.append(built)
        except BaseException:
            loggers.finish("FAILED")  # the ones already started say the run failed
            raise
        return loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.jsonl.log(metrics, step)
        for logger in self.external:
            logger.log(metrics, step)

    def finish(self, status: str = "FINISHED") -> None:
        """Every logger finishes, even after one that fails to (its error is raised once all have)."""
        if self in _OPEN:
            _OPEN.remove(self)
        self.jsonl.finish()
        errors = []
        for logger in self.external:
            try:
                finish(logger, status)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


class Progress:
    """A progress bar on rank 0 when it writes to a terminal, plain log lines otherwise."""

    def __init__(self, rank: int, total: int, enabled: bool) -> None:
        self.rank = rank
        self.bar = None
        if rank == 0 and enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float] | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if metrics:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", samples_s=f"{metrics['samples_per_s']:.0f}")
        elif self.rank == 0 and metrics:
            extra = f" | val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
            print(
                f"step {step} | loss {metrics['loss']:.4f}{extra} | lr {metrics['lr']:.2e} | "
                f"{metrics['step_time_s']:.3f} s/step | {_rate(metrics)}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rate(metrics: dict[str, float]) -> str:
    if "tokens_per_s" in metrics:
        return f"{metrics['tokens_per_s']:.0f} tok/s"
    return f"{metrics['samples_per_s']:.1f} samples/s"
