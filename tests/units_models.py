"""Models for tests of FSDP's units and of BatchNorm: a small CNN with BatchNorm layers, its images, and toy models
whose parameters are tied across modules.

`model=custom model._target_=units_models.BatchNormNet data=custom data._target_=units_models.images`
(tests/ is on the workers' PYTHONPATH).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from user_models import Images


class BatchNormNet(nn.Module):
    """Conv-BatchNorm-ReLU twice, then a head over the pooled features: its training forward depends on the batch's
    statistics, so a micro-batch normalised alone differs from the same samples normalised together. The convolutions
    have no bias, as usual before a BatchNorm: its gradient would be rounding noise, which Adam scales up to steps of
    the learning rate, and the running means would follow that noise."""

    def __init__(self, channels: int = 3, classes: int = 3, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.head = nn.Linear(width, classes)

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(image).mean(dim=(2, 3))), label)


def images(split: str, count: int = 256, size: int = 8, channels: int = 3) -> Images:
    """Seeded images whose label is the channel of the largest mean, shifted and scaled away from N(0, 1) so that
    normalising them matters."""
    data = Images(split, count if split == "train" else count // 4, size, channels)
    data.images = data.images * 3.0 + 1.5
    return data


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, width)


class TiedAcrossBlocks(nn.Module):
    """Blocks that share one weight (the second block's linear is the first's), an embedding unit tied to the
    head in the root, and an untied block: the shapes of ties a model's own `_no_split_modules` may split."""

    _no_split_modules = ["Block", "Embedding", "Plain"]

    def __init__(self, vocab: int = 11, width: int = 4) -> None:
        super().__init__()
        self.embed = Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.blocks[1].linear.weight = self.blocks[0].linear.weight
        self.plain = Plain(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.table.weight


class Plain(Block):
    pass
