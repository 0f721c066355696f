"""The built-in GPT fed the batches a transformers causal LM takes (data.format=hf: {input_ids, labels}, the labels
unshifted), from a weights file: the launcher's side of the comparison with an exported folder trained on as
model=custom (tests/test_export.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from launcher.models.gpt import GPT


class GPTOnHFBatches(GPT):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        targets = torch.full_like(labels, -100)
        targets[:, :-1] = labels[:, 1:]  # what a transformers causal LM's own shift makes of them
        return super().forward(input_ids, targets)["loss"]  # their mean, as a transformers model returns its loss


def gpt_from_file(path: str, **sizes: int) -> GPTOnHFBatches:
    model = GPTOnHFBatches(**sizes)
    model.load_state_dict(load_file(path))
    return model
