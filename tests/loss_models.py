"""Transformers models of other families than the causal LM, built from tiny configs (no download), and data for
them whose samples hold different numbers of targets: what the loss contract is tested on (test_loss_families.py).

`model=custom model._target_=loss_models.masked_lm data=custom data._target_=loss_models.masked_text`
(tests/ is on the workers' PYTHONPATH). Each factory seeds its own weights: every strategy and world size, and a
test's plain forward, start from the same model.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

VOCAB = 256
SEQ_LEN = 16
MASK, PAD = 1, 0


def masked_lm(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def seq2seq(seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=PAD,
        pad_token_id=PAD,
    )
    return T5ForConditionalGeneration(config)


class _Seeded(Dataset):
    """`count` samples of a split, each drawn from a generator seeded by its index (the splits' seeds apart)."""

    def __init__(self, split: str, count: int) -> None:
        self.offset, self.count = (0 if split == "train" else 1_000_000), count

    def __len__(self) -> int:
        return self.count

    def generator(self, i: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.offset + i)


class MaskedText(_Seeded):
    """Random token rows with 1 to SEQ_LEN/2 positions masked, how many and where seeded by the sample's index:
    `labels` hold the original token there and -100 elsewhere."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = self.generator(i)
        ids = torch.randint(2, VOCAB, (SEQ_LEN,), generator=g)
        masked = torch.randperm(SEQ_LEN, generator=g)[: int(torch.randint(1, SEQ_LEN // 2 + 1, (1,), generator=g))]
        labels = torch.full_like(ids, -100)
        labels[masked] = ids[masked]
        inputs = ids.clone()
        inputs[masked] = MASK
        return {"input_ids": inputs, "labels": labels}


class Reversal(_Seeded):
    """Source rows of 2 to SEQ_LEN tokens (padded, `attention_mask` 0 there) whose target is the source reversed:
    `labels` as long as the source, -100 after it. Lengths seeded by the sample's index."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = self.generator(i)
        n = int(torch.randint(2, SEQ_LEN + 1, (1,), generator=g))
        source = torch.randint(2, VOCAB, (n,), generator=g)
        inputs, mask, labels = (
            torch.full((SEQ_LEN,), PAD),
            torch.zeros(SEQ_LEN, dtype=torch.long),
            torch.full((SEQ_LEN,), -100),
        )
        inputs[:n], mask[:n], labels[:n] = source, 1, source.flip(0)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}


def masked_text(split: str, count: int = 64) -> MaskedText:
    return MaskedText(split, count if split == "train" else count // 4)


def reversal(split: str, count: int = 64) -> Reversal:
    return Reversal(split, count if split == "train" else count // 4)
