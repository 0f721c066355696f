"""A model that straggles on purpose, for the straggler tests: `model._target_=straggler_models.SlowGPT` (tests/ is
on PYTHONPATH)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from launcher.models.gpt import GPT


class SlowGPT(GPT):
    """The built-in GPT whose training forward sleeps `sleep_s` seconds on rank `slow_rank` only (read from the process
    group inside forward: the launcher's own forward, before any group exists, never sleeps)."""

    def __init__(self, *args, sleep_s: float = 0.0, slow_rank: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_s, self.slow_rank = sleep_s, slow_rank

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and dist.is_initialized() and dist.get_rank() == self.slow_rank:
            time.sleep(self.sleep_s)
        return super().forward(idx, targets)
