"""Models and data of the kind users bring, for tests: not language models, constructors with their own arguments.

`model=custom model._target_=user_models.Classifier +model.width=32 data=custom data._target_=user_models.images`
(tests/ is on the workers' PYTHONPATH).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Classifier(nn.Module):
    """A small convolutional classifier of (image, label) pairs: no tokens, no `_no_split_modules`."""

    def __init__(self, channels: int = 3, classes: int = 3, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(width, classes)

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(image).mean(dim=(2, 3)))
        return F.cross_entropy(logits, label)


class Images(Dataset):
    """Seeded random images whose label is the channel with the largest mean: learnable, fixed per split."""

    def __init__(self, split: str, count: int, size: int, channels: int) -> None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.images = torch.randn(count, channels, size, size, generator=generator)
        self.labels = self.images.mean(dim=(2, 3)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def images(split: str, count: int = 256, size: int = 8, channels: int = 3) -> Images:
    return Images(split, count if split == "train" else count // 4, size, channels)


class RecordingLogger:
    """A logger of one's own (`logger=custom logger.custom._target_=user_models.RecordingLogger
    +logger.custom.file=NAME`), written to the plain contract (`finish()`): each call, as JSON lines, into
    `<run dir>/NAME`."""

    def __init__(self, run_config: dict, run_dir: str, file: str) -> None:
        self.out = open(Path(run_dir) / file, "w")
        self._write({"call": "init", "model": run_config["model"]["_target_"]})

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._write({"call": "log", "step": step, "metrics": metrics})

    def finish(self) -> None:
        self._write({"call": "finish"})
        self.out.close()


class OldStrategy:
    """A strategy of the user's, written to the protocol before strategies declared their collectives, requirements
    and conformance: refused before start, naming what it lacks."""

    def __init__(self, **options: object) -> None:
        self.options = options

    def layout(self) -> object: ...
    def check(self, ctx: object, model: object) -> None: ...
    def setup(self, ctx: object, build_model: object, build_optimizer: object) -> None: ...
    def forward(self, batch: object) -> object: ...
    def sync(self, enabled: bool) -> object: ...
    def backward(self, loss: object) -> None: ...
    def step(self, lr: float) -> float: ...
    def train(self, mode: bool) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def metrics(self) -> dict: ...
    def teardown(self) -> None: ...


def step_halving(step: int, max_steps: int, every: int = 4) -> float:
    """A learning-rate schedule of a user's own (trainer.schedule=custom): optim.lr, halved every `every` steps."""
    return 0.5 ** (step // every)


class NoMatrices(torch.nn.Module):
    """A model with no 2-D hidden matrix (an embedding and a norm only): nothing for Muon to step."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.norm = torch.nn.Embedding(256, 8), torch.nn.LayerNorm(8)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embedding(idx)).mean()


def frozen_gpt(**keys: object) -> torch.nn.Module:
    """The built-in GPT with every parameter frozen (`requires_grad=False`): nothing for an optimizer to train."""
    from launcher.models.gpt import GPT

    return GPT(**keys).requires_grad_(False)  # type: ignore[arg-type]


def forgotten_return(**keys: object) -> None:
    """A builder of the user's that makes the model and forgets to return it."""
    from launcher.models.gpt import GPT

    GPT(**keys)  # type: ignore[arg-type]


class SaysNothing(torch.nn.Module):
    """A model whose forward computes and returns nothing."""

    def __init__(self, **keys: object) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(256, 8)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> None:
        self.embedding(idx)
