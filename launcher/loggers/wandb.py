"""Weights & Biases: the logger (`WandbLogger`, `logger=wandb`), its modes and its reach."""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path
from typing import Any

from launcher.base.settings import Settings
from launcher.loggers.base import last_logged_step


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
