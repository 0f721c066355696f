"""Models, data and metrics of the evaluation tests (`tests/test_evaluation.py`): a classifier in nanoGPT's shape,
built from a config object, whose forward returns `(logits, loss)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from user_models import Images


@dataclass
class NanoConfig:
    """As nanoGPT's `GPTConfig`: the model's sizes in one object."""

    channels: int = 3
    classes: int = 4
    width: int = 8


class NanoClassifier(nn.Module):
    """nanoGPT's contract on images: `NanoClassifier(NanoConfig(...))`, `forward(x, targets)` returns
    `(logits, loss)`."""

    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.config = config
        self.features = nn.Sequential(nn.Conv2d(config.channels, config.width, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(config.width, config.classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.head(self.features(x).mean(dim=(2, 3)))
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss


def images(split: str, count: int = 64, val_count: int = 13, channels: int = 3) -> Images:
    """`count` training images of 6 x 6, and an odd number of validation images (`val_count`)."""
    return Images(split, count if split == "train" else val_count, 6, channels)


class Numbered(torch.utils.data.IterableDataset):
    """A stream of `count` samples, each its own number from `first` on: `torch.tensor([n])`."""

    def __init__(self, count: int, first: int = 0) -> None:
        self.count, self.first = count, first

    def __iter__(self):
        return (torch.tensor([self.first + i]) for i in range(self.count))


def numbered(split: str, count: int = 30, first: int = 0, stream: bool = False) -> Any:
    """Samples that are their own numbers, `first` to `first + count - 1`: a list (map-style), or a stream of them
    (`Numbered`); the evaluation tests tell which samples a pass counts by them."""
    return Numbered(count, first) if stream else [torch.tensor([first + i]) for i in range(count)]


def correct(output: tuple[torch.Tensor, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """A metric of one's own: (predictions that are right, predictions)."""
    logits, _ = output
    return (logits.argmax(dim=-1) == batch[1]).sum(), batch[1].numel()


class Recording:
    """A callback of one's own, on every rank: each call, as a JSON line, into `<folder>/calls<rank>.jsonl`."""

    every_rank = True

    def __init__(self, folder: str) -> None:
        import os

        self.path = f"{folder}/calls{os.environ.get('RANK', '0')}.jsonl"

    def _write(self, hook: str, step: int, figures: dict) -> None:
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps({"hook": hook, "step": step, "figures": sorted(figures)}) + "\n")

    def on_train_start(self, step: int, figures: dict) -> None:
        self._write("on_train_start", step, figures)

    def on_step_end(self, step: int, figures: dict) -> None:
        self._write("on_step_end", step, figures)

    def on_eval_end(self, step: int, figures: dict) -> None:
        self._write("on_eval_end", step, figures)

    def on_save(self, step: int, figures: dict) -> None:
        self._write("on_save", step, figures)

    def on_train_end(self, step: int, figures: dict) -> None:
        self._write("on_train_end", step, figures)


class Raising:
    """A callback that raises at the end of step `at`, on rank 0 only."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, step: int, figures: dict) -> None:
        if step == self.at:
            raise RuntimeError(f"planted failure at step {step}")


def sentences(output: object, batch: dict) -> tuple[list[str], list[list[str]]]:
    """BLEUScore's inputs from a seq2seq model's output: each row's predicted tokens (the teacher-forced argmax) and
    its labels, as sentences of token ids, -100 positions left out."""
    predicted, labels = output.logits.argmax(dim=-1), batch["labels"]
    keep = labels != -100
    said = [" ".join(map(str, row[k].tolist())) for row, k in zip(predicted, keep)]
    truth = [[" ".join(map(str, row[k].tolist()))] for row, k in zip(labels, keep)]
    return said, truth


class Averaged(Metric):
    """A torchmetrics Metric whose state is averaged over ranks (exact only where every rank holds as many)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("value", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.value = preds.float().mean()

    def compute(self) -> torch.Tensor:
        return self.value
