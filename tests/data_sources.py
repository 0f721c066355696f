"""Data of the kinds users bring, made on the spot with no download, for tests/test_data_sources.py (workers import
them by name: the tests put this folder on PYTHONPATH): torch_geometric graphs and a GCN classifier, a user's
IterableDataset that ends, jsonl corpora for data=hf, one-shot and empty streams for the refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset


def graphs(split: str, count: int = 96, features: int = 8) -> list[Any]:
    """`count` random graphs of 4 to 12 nodes (torch_geometric `Data`), each labelled by the sign of its nodes' first
    feature's mean: a map-style dataset (a list) whose items `default_collate` cannot stack."""
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    items = []
    for _ in range(count):
        n = int(torch.randint(4, 13, (1,), generator=g))
        x = torch.randn(n, features, generator=g)
        edges = torch.randint(0, n, (2, 2 * n), generator=g)
        items.append(Data(x=x, edge_index=edges, y=torch.tensor([int(x[:, 0].mean() > 0)])))
    return items


class GraphClassifier(nn.Module):
    """Two GCN layers, a mean pool per graph and a linear head: PyG's graph classification, taking a `Batch`."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 2) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1, self.conv2 = GCNConv(features, hidden), GCNConv(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, batch: Any) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        h = self.conv1(batch.x, batch.edge_index).relu()
        h = self.conv2(h, batch.edge_index).relu()
        return F.cross_entropy(self.head(global_mean_pool(h, batch.batch, size=batch.num_graphs)), batch.y)


class Tokens(IterableDataset):
    """A user's stream with no state_dict: `count` samples (inputs, next-token targets) of `seq_len` random tokens,
    the same every time it is iterated."""

    def __init__(self, count: int, seq_len: int = 16, vocab: int = 256) -> None:
        self.count, self.seq_len, self.vocab = count, seq_len, vocab

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(7)
        for _ in range(self.count):
            chunk = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
            yield chunk[:-1], chunk[1:]


def token_stream(split: str, count: int, seq_len: int = 16) -> Tokens:
    return Tokens(count if split == "train" else 64, seq_len)


def one_shot(split: str) -> Any:
    """A generator: a stream that can be read once only."""
    return (torch.zeros(4) for _ in range(64))


def strings(split: str) -> list[dict[str, Any]]:
    """Rows as `datasets` gives them, with a text field left in."""
    return [{"input_ids": [1, 2, 3], "text": "hello"} for _ in range(64)]


def no_tensors(samples: list[Any]) -> list[str]:
    """A collate that returns no tensor."""
    return [str(s) for s in samples]


WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def write_rows(path: Path, count: int, seed: int = 0, words: tuple[int, int] = (2, 40)) -> Path:
    """`count` jsonl rows {"text", "label"}: texts of `words` random words (lengths differ), labelled by whether
    "fox" is in them."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
            f.write(json.dumps({"text": text, "label": int("fox" in text)}) + "\n")
    return path
