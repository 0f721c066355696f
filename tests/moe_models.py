"""Models for tests of mixture-of-experts and of the preflight: a hand-written MoE whose ranks route to different
experts, the data it reads, and a tiny transformers MoE built from a config.

`model=custom model._target_=moe_models.TopOneMoE data=custom data._target_=moe_models.points`
(tests/ is on the workers' PYTHONPATH).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

DIM, EXPERTS, CLASSES = 8, 4, 4


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing over a list of experts; an expert no sample of the micro-batch is routed to does not run, so
    its parameters get no gradient on that rank."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = F.softmax(self.gate(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
        return x + out


class TopOneMoE(nn.Module):
    """Points in, a class out, through one MoE layer. Its routing is readable: `route(x)` is the expert each point
    goes to at the current weights."""

    def __init__(self, dim: int = DIM, experts: int = EXPERTS, classes: int = CLASSES) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim, bias=False)  # 1252 parameters: ZeRO-1/2's buckets (1/8) align to 2
        self.moe = MoE(dim, experts)
        self.head = nn.Linear(dim, classes)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe.gate(self.embed(x)).argmax(dim=-1)

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.moe(self.embed(x))), label)


class Points(Dataset):
    """Seeded random points whose label is the sign pattern of two coordinates."""

    def __init__(self, split: str, count: int, dim: int) -> None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.x = 2 * torch.randn(count, dim, generator=generator)
        self.y = (self.x[:, 0] > 0).long() * 2 + (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def points(split: str, count: int = 64, dim: int = DIM) -> Points:
    return Points(split, count if split == "train" else count // 4, dim)


MIXTRAL = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "router_jitter_noise": 0.0,
    "attention_dropout": 0.0,
    "output_router_logits": False,
}


def mixtral(**overrides: object) -> nn.Module:
    """A tiny MixtralForCausalLM from a config (no download), jitter and dropout off."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**{**MIXTRAL, **overrides}))
