"""data=mix: the training loss of each source's samples on a logged step, reduced exactly over ranks.

Each micro-batch's rows come with their source (`StepData.sources`); after each forward, the model's own logits give
every row's summed token loss and its targets (a transformers model's `labels`, by its rule: `LabelRule`, or a
tuple's targets as they stand), with no gradient; the sums and counts of every source, over the step's micro-batches
and all ranks (one all-reduce), make `loss/NAME` = Σ token losses / Σ targets of that source's samples. A model whose
output holds no `logits` logs none (its loss is a single number per micro-batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher.models.loss import IGNORE_INDEX, LabelRule


class SourceLosses:
    """The per-source sums of one logged step, on this rank, until `figures` reduces them."""

    def __init__(self, names: list[str], rule: LabelRule) -> None:
        self.names, self.rule = names, rule
        self.sums = torch.zeros(2 * len(names), dtype=torch.float64)

    @classmethod
    def of(cls, source: Any, rule: LabelRule) -> SourceLosses | None:
        """For a mixture's source (one that names its parts), else None."""
        parts = getattr(getattr(source, "mixture", None), "parts", None)
        return cls([p.name for p in parts], rule) if parts else None

    def seer(self, rows: list[Any] | None) -> Any:
        """The callback `train_step` calls after each forward: (micro-step k, the model's output, the batch)."""
        if rows is None:
            return None

        def seen(k: int, output: Any, batch: Any) -> None:
            self.see(output, batch, torch.as_tensor(rows[k]))

        return seen

    def see(self, output: Any, batch: Any, rows: torch.Tensor) -> None:
        logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
        if isinstance(batch, Mapping):
            labels, shift = batch.get("labels"), self.rule.label_shift or 0
        else:
            labels, shift = (batch[-1] if isinstance(batch, (list, tuple)) and batch else None), 0
        if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor) or logits.dim() != 3:
            return
        with torch.no_grad():
            logits, labels = logits[:, : logits.size(1) - shift].float(), labels[:, shift:]
            token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="none").view(labels.shape)  # fmt: skip
            per_row = token.sum(-1).double().cpu()
            targets = (labels != IGNORE_INDEX).sum(-1).double().cpu()
        for i in range(len(self.names)):
            mine = rows == i
            self.sums[2 * i] += per_row[mine].sum()
            self.sums[2 * i + 1] += targets[mine].sum()

    def figures(self, device: torch.device) -> dict[str, float]:
        """`loss/NAME` over every rank's samples of the step (one all-reduce, on every rank alike), then reset."""
        total = self.sums.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total, self.sums = total.cpu(), torch.zeros_like(self.sums)
        return {f"loss/{n}": float(total[2 * i] / total[2 * i + 1]) for i, n in enumerate(self.names)
                if total[2 * i + 1] > 0}  # fmt: skip
