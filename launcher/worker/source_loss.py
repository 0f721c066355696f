"""data=mix: the training loss of each source's samples on a logged step, reduced exactly over ranks.

Each micro-batch's rows come with their source (`StepData.sources`); after each forward, the model's own per-row losses
(the built-in GPT's `row_loss`) or its logits give every row's summed token loss and its targets (a transformers model's
`labels`, by its rule: `LabelRule`, or a tuple's targets as they stand), with no gradient; the sums and counts of every
source, over the step's micro-batches and all ranks (one all-reduce), make `loss/NAME` = Σ token losses / Σ targets of
that source's samples, and `tokens/NAME` its samples' input tokens in the step. A model whose output holds neither logs
no `loss/NAME` (its loss is a single number per micro-batch)."""

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
        self.sums = torch.zeros(3 * len(names), dtype=torch.float64)
        """Per source: Σ token losses, Σ targets, Σ input tokens (the elements of its rows' token ids)."""

    @classmethod
    def of(cls, source: Any, rule: LabelRule) -> SourceLosses:
        """For a mixture's source, its parts; for any other, none (it then logs nothing and reduces nothing)."""
        parts = getattr(getattr(source, "mixture", None), "parts", None) or []
        return cls([p.name for p in parts], rule)

    def seer(self, rows: list[Any] | None, logged: bool) -> Any:
        """The callback `train_step` calls after each forward of a logged step: (micro-step k, the model's output,
        the batch); None for other steps and other data."""
        if rows is None or not logged or not self.names:
            return None

        def seen(k: int, output: Any, batch: Any) -> None:
            self.see(output, batch, torch.as_tensor(rows[k]))

        return seen

    def see(self, output: Any, batch: Any, rows: torch.Tensor) -> None:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(batch, (list, tuple)) and batch:
            ids = batch[0]
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() >= 2:
            per_row = torch.full((len(rows),), float(ids[0].numel()), dtype=torch.float64)
            for i in range(len(self.names)):
                self.sums[3 * i + 2] += per_row[rows == i].sum()
        logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
        rows_loss = output.get("row_loss") if isinstance(output, Mapping) else None  # the built-in GPT's own
        if isinstance(batch, Mapping):
            labels, shift = batch.get("labels"), self.rule.label_shift or 0
        else:
            labels, shift = (batch[-1] if isinstance(batch, (list, tuple)) and batch else None), 0
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            return
        with torch.no_grad():
            if isinstance(rows_loss, torch.Tensor) and rows_loss.shape == labels.shape[:1]:
                per_row = rows_loss.double().cpu()
            elif isinstance(logits, torch.Tensor) and logits.dim() == 3:
                logits, labels = logits[:, : logits.size(1) - shift].float(), labels[:, shift:]
                token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="none").view(labels.shape)  # fmt: skip
                per_row = token.sum(-1).double().cpu()
            else:
                return
            targets = (labels != IGNORE_INDEX).sum(-1).double().cpu()
        for i in range(len(self.names)):
            mine = rows == i
            self.sums[3 * i] += per_row[mine].sum()
            self.sums[3 * i + 1] += targets[mine].sum()

    def figures(self, device: torch.device, state: Any) -> dict[str, float]:
        """The mixture's figures from its `state` after the step (`mix_figures`), and `loss/NAME` and `tokens/NAME`
        over every rank's samples of the step (one all-reduce, on every rank alike); then reset."""
        from launcher.data.mix import mix_figures

        if not self.names:  # not a mixture, on every rank alike: no collective
            return {}
        total = self.sums.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total, self.sums = total.cpu(), torch.zeros_like(self.sums)
        figures = mix_figures(state)
        figures |= {f"tokens/{n}": float(total[3 * i + 2]) for i, n in enumerate(self.names) if total[3 * i + 2] > 0}
        for i, n in enumerate(self.names):
            if total[3 * i + 1] > 0:
                figures[f"loss/{n}"] = float(total[3 * i] / total[3 * i + 1])
        return figures
