"""TensorBoard from rank 0 (`logger=tensorboard`): event files written by torch's `SummaryWriter`, one folder per job.

The folder: `<run dir>/tensorboard`, or with `logger.tensorboard.log_dir` set `<log_dir>/<group>/<name>` (name: the
job's run id unless set; a sweep sets group and name). Every attempt of the job (an elastic restart, a requeue,
`resume=` of the run directory) writes a new event file into the same folder, opened with `purge_step` at the first
step it logs: TensorBoard then drops what earlier files hold from that step on (the steps an attempt logged past the
checkpoint the next one resumed from), so that no step shows twice and the last attempt's figures are the ones seen.
TensorBoard and its `EventAccumulator` apply the purge to scalars; a reader of the raw events (tbparse 0.0.9) does not.

What the folder holds: every figure metrics.jsonl gets as a scalar at its step, the resolved config as text (`config`,
at the first step each attempt logs), and how each attempt ended as text (`status`, at its last logged step:
FINISHED, FAILED or KILLED); texts are not purged, so each attempt's stay.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from launcher.base.settings import Settings
from launcher.loggers.base import last_logged_step
from launcher.loggers.checks import can_make, installed

FOLDER = "tensorboard"
EXTRA = "pip install 'launch[tensorboard]'"


def _folder_name(key: str, value: str | None) -> None:
    if value is not None and (not str(value) or "/" in str(value) or str(value) in (".", "..")):
        raise ValueError(f"logger.tensorboard.{key}={value!r} is not a folder name (no /, not . or ..)")


class TensorBoardLogger:
    """One event folder per job (see the module's docstring)."""

    @staticmethod
    def check(**keys: Any) -> None:
        """Its package installed, its folder writable: ImportError or ValueError (one line). `keys`:
        logger.tensorboard's (launcher/config/schema.py: `TensorBoardConfig`, their one place)."""
        tensorboard = Settings(**keys)
        if not installed("tensorboard"):
            raise ImportError(f"logger=tensorboard needs the tensorboard package, which is not installed: {EXTRA}")
        _folder_name("group", tensorboard.group)
        _folder_name("name", tensorboard.name)
        log_dir = tensorboard.log_dir
        if log_dir is not None and not can_make(Path(log_dir)):
            raise ValueError(f"logger.tensorboard.log_dir={log_dir} cannot be made or written by this user")

    def __init__(self, run_config: dict[str, Any], run_dir: str, **keys: Any) -> None:
        """`keys`: logger.tensorboard's (launcher/config/schema.py: `TensorBoardConfig`)."""
        import yaml

        tb, job = Settings(**keys), run_config.get("job") or {}
        if tb.log_dir is None:
            self.folder = Path(run_dir) / FOLDER
        else:
            self.folder = (
                Path(tb.log_dir) / (tb.group or "") / (tb.name or str(job.get("run_id") or Path(run_dir).name))
            )
        self.before = last_logged_step(Path(run_dir) / "metrics.jsonl")  # what earlier attempts logged
        text = yaml.safe_dump(run_config, sort_keys=False)
        self.config = "\n".join(f"    {line}" for line in text.splitlines())  # a code block in TensorBoard's markdown
        self.writer: Any = None
        self.last = 0

    def _open(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only rank 0 of a run that asked

        earlier = self.folder.is_dir() and any(self.folder.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(self.folder), purge_step=step if earlier else None)
        if earlier and self.before >= step:
            steps = f"step {step}" if step == self.before else f"steps {step}..{self.before}"
            print(
                f"tensorboard: {steps} an earlier attempt logged in {self.folder} are replaced by this attempt's "
                "(purge_step)",
                file=sys.stderr,
                flush=True,
            )
        self.writer.add_text("config", self.config, step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            self._open(step)
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # each logged step on disk, as metrics.jsonl's line is
        self.last = step

    def finish(self, status: str = "FINISHED") -> None:
        if self.writer is None:
            return
        self.writer.add_text("status", status, self.last)
        self.writer.close()
        print(f"tensorboard: logged to {self.folder}; view with: tensorboard --logdir {self.folder}", file=sys.stderr)
