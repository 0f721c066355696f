"""data=mix: the training loss of each source's samples on a logged step, reduced exactly over ranks, and each source's
input tokens so far.

Each micro-batch's rows come with their source (`StepData.sources`); after each forward, the model's own per-row losses
(the built-in GPT's `row_loss`) or its logits give every row's summed token loss and its targets (a transformers model's
`labels`, by its rule: `LabelRule`, or a tuple's targets as they stand), with no gradient; the sums and counts of every
source, over the step's micro-batches and all ranks (one all-reduce), make `loss/NAME` = Σ token losses / Σ targets of
that source's samples. A model whose output holds neither logs no `loss/NAME` (its loss is a single number per
micro-batch). `tokens/NAME` is a running total, like `samples/NAME`: each step's input tokens of the source's rows (the
elements of their token ids), summed over ranks in one small all-reduce a step, added to the total the mixture's state
records, so a checkpoint of any step holds it and a resume goes on from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher.models.loss import IGNORE_INDEX, LabelRule


class SourceLosses:
    """The per-source sums of one logged step, on this rank, until `figures` reduces them; the tokens so far."""

    def __init__(self, names: list[str], rule: LabelRule, tokens: dict[str, float] | None = None) -> None:
        self.names, self.rule = names, rule
        self.sums = torch.zeros(2 * len(names), dtype=torch.float64)
        """Per source: Σ token losses, Σ targets."""
        self.tokens = {n: float((tokens or {}).get(n, 0.0)) for n in names}
        """Per source: the input tokens of its samples so far, over all ranks (`recorded`)."""
        self.replicas, self.rank, self.uncounted = 1, 0, 0
        """Ranks that see the same micro-batches (a tensor-parallel group), whose rows count once; this rank; the step
        of a checkpoint resumed from that recorded no tokens (said once the first step counts some)."""

    @classmethod
    def of(cls, source: Any, rule: LabelRule, position: Any = None, rank: int = 0, replicas: int = 1) -> SourceLosses:
        """For a mixture's source, its parts, their tokens so far from the resumed `position`'s state; for any other,
        none (it then logs nothing and reduces nothing)."""
        parts = getattr(getattr(source, "mixture", None), "parts", None) or []
        stream = getattr(position, "stream", None)
        rows = ((stream or {}).get("mix") or {}).get("sources", {}) if isinstance(stream, dict) else {}
        tokens = {name: row["tokens"] for name, row in rows.items() if isinstance(row, dict) and "tokens" in row}
        losses = cls([p.name for p in parts], rule, tokens)
        losses.replicas, losses.rank = replicas, rank
        losses.uncounted = position.step if parts and rows and not tokens and position.step else 0
        return losses

    def seer(self, rows: list[Any] | None, logged: bool) -> Any:
        """The callback `train_step` calls after each forward of a logged step: (micro-step k, the model's output,
        the batch); None for other steps and other data."""
        if rows is None or not logged or not self.names:
            return None

        def seen(k: int, output: Any, batch: Any) -> None:
            self.see(output, batch, torch.as_tensor(rows[k]))

        return seen

    def recorded(self, data: Any, device: torch.device) -> Any:
        """The step's state (`data.state`) with each source's tokens so far: this rank's rows' input tokens of the
        step, summed over ranks (one all-reduce, on every rank alike), added to the total. Batches without token ids
        (graphs, features) record none. Other data: as it is."""
        if not self.names or data.sources is None:  # not a mixture, on every rank alike: no collective
            return data.state
        mine = torch.zeros(len(self.names) + 1, dtype=torch.float64)  # per source, then: ranks that saw token ids
        for batch, rows in zip(data.micro, data.sources):
            ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
            if isinstance(batch, (list, tuple)) and batch:
                ids = batch[0]
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() >= 2:
                mine[-1] = 1.0
                rows = torch.as_tensor(rows)
                for i in range(len(self.names)):
                    mine[i] += float((rows == i).sum()) * ids[0].numel()
        total = mine.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        *step, seen = total.cpu().tolist()
        if seen and self.uncounted and self.rank == 0:
            print(
                f"launch: data: the checkpoint of step {self.uncounted} records no tokens per source (it was written "
                f"before they were counted): tokens/NAME counts from step {self.uncounted + 1} on",
                flush=True,
            )
        if seen:
            self.uncounted = 0
            for name, got in zip(self.names, step):
                self.tokens[name] += got / self.replicas
                data.state["mix"]["sources"][name]["tokens"] = self.tokens[name]
        return data.state

    def see(self, output: Any, batch: Any, rows: torch.Tensor) -> None:
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
                if hasattr(logits, "full_tensor"):  # split by vocabulary (strategy.loss_parallel): whole, for this
                    logits = logits.full_tensor()
                logits, labels = logits[:, : logits.size(1) - shift].float(), labels[:, shift:]
                token = F.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
                ).view(labels.shape)
                per_row = token.sum(-1).double().cpu()
            else:
                return
            targets = (labels != IGNORE_INDEX).sum(-1).double().cpu()
        for i in range(len(self.names)):
            mine = rows == i
            self.sums[2 * i] += per_row[mine].sum()
            self.sums[2 * i + 1] += targets[mine].sum()

    def figures(self, device: torch.device, state: Any) -> dict[str, float]:
        """The mixture's figures from its `state` after the step (`mix_figures`: samples, fractions, epochs and tokens
        so far), and `loss/NAME` over every rank's samples of the step (one all-reduce, on every rank alike); then
        reset."""
        from launcher.mixture.mix import mix_figures

        if not self.names:  # not a mixture, on every rank alike: no collective
            return {}
        total = self.sums.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total, self.sums = total.cpu(), torch.zeros_like(self.sums)
        figures = mix_figures(state)
        for i, n in enumerate(self.names):
            if total[2 * i + 1] > 0:
                figures[f"loss/{n}"] = float(total[2 * i] / total[2 * i + 1])
        return figures
