"""Models for the guards' tests: `model._target_=guard_models.NaNGPT` (tests/ is on PYTHONPATH)."""

from __future__ import annotations

import os

import torch

from launcher.models.gpt import GPT


class NaNGPT(GPT):
    """The built-in GPT whose loss is NaN on rank `GUARD_NAN_RANK` (1 unless set) at the training forward calls listed
    in `GUARD_NAN_CALLS` (comma-separated, 1-based, counted per process). The NaN is added to the loss, so the
    gradient alone would stay finite: the launcher must still drop the step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad = os.environ.get("RANK") == os.environ.get("GUARD_NAN_RANK", "1")
        self.nan_calls = {int(c) for c in os.environ.get("GUARD_NAN_CALLS", "").split(",") if c}
        self.calls = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(idx, targets)
        if not self.bad or not self.training:
            return out
        self.calls += 1
        if self.calls not in self.nan_calls:
            return out
        nan = torch.tensor(float("nan"), device=idx.device)
        return {**out, "loss": out["loss"] + nan, "loss_sum": out["loss_sum"] + nan}


class WideTokens(torch.utils.data.Dataset):
    """User data of (ids, targets) windows whose sample 0 is in a vocabulary of 256 and every other sample holds the
    id 300: the launcher's one meta forward of sample 0 passes, the workers must catch the rest."""

    def __init__(self, split: str, seq_len: int = 32, samples: int = 64) -> None:
        self.seq_len, self.samples = seq_len, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.arange(self.seq_len + 1) % 256
        if i:
            ids[3] = 300
        return ids[:-1], ids[1:]
