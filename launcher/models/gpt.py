"""A GPT decoder (pre-norm, tied embeddings) using scaled_dot_product_attention.

forward(idx, targets) returns the summed next-token cross-entropy and the number of targets (and their mean as
`loss`), so that the runner normalises the loss of a step by the targets of the whole global batch: exact on
padded data (targets of -100 count for nothing) whatever the accumulation and the world size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.n_head, self.head_dim = n_head, n_embd // n_head
        # Three projections, not one fused: tensor parallel splits each by heads (`_tp_plan`).
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads from the tensors' widths, not n_head: under tensor parallel a rank holds n_head / T of them.
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """One transformer block: the unit that sharding strategies wrap and checkpointing recomputes."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    _no_split_modules = ["Block"]  # its layer-sized units, declared as transformers models declare theirs
    _tp_plan = {  # its tensor-parallel plan, in transformers' names (`strategies.tp_plans`), sequence parallel
        "tok_emb": "embedding_rowwise",  # the vocabulary split, its output all-reduced whole (the positions added)
        "blocks.0": "sequence_split",  # from here to the head, each rank holds its part of the sequence
        "blocks.*.ln1": "sequence_parallel",
        "blocks.*.attn": "sequence_gather",  # the sequence whole for attention, its heads split
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise_sequence",
        "blocks.*.ln2": "sequence_parallel",
        "blocks.*.mlp": "sequence_gather",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise_sequence",
        "ln_f": "sequence_gather",  # the sequence whole again, for the head
        "head": "colwise_rep",
    }

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_embd: int,
        vocab_size: int,
        block_size: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size, self.vocab_size = block_size, vocab_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix for input and output
        self.n_layer = n_layer
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; output projections scaled by depth.

        Through `Module.apply`, one module at a time: under DeepSpeed's `zero.Init` each layer is
        partitioned as soon as it is built, and `apply` is where it gathers them to let a parent
        initialise them. Same order, values and random draws as a plain loop over named_parameters.
        """
        names = {id(p): name for name, p in self.named_parameters()}
        done: set[int] = set()

        def init(module: nn.Module) -> None:
            for p in module.parameters(recurse=False):
                if id(p) in done:  # the tied head weight is the embedding: initialised once
                    continue
                done.add(id(p))
                name = names[id(p)]
                if p.dim() < 2:
                    nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
                else:
                    std = 0.02 / math.sqrt(2 * self.n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        self.apply(init)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        flat = targets.reshape(-1)
        token_loss = F.cross_entropy(logits.view(-1, logits.size(-1)), flat, reduction="none")  # -100: 0, no target
        loss_sum = token_loss.sum()
        num_tokens = (flat != -100).sum()
        # Each row's summed loss beside the total (no gradient): a mixture's loss per source (launcher.worker).
        row_loss = token_loss.detach().view(idx.shape).sum(-1)
        mean = loss_sum / num_tokens.clamp(min=1)
        return {"loss": mean, "loss_sum": loss_sum, "num_tokens": num_tokens, "row_loss": row_loss, "logits": logits}
