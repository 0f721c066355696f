"""Several optimizers over one model: a rule of `optim.groups` that names a `_target_` (another optimizer class, with
its keys) has its parameters stepped by that optimizer, and every other group by optim's own, as optim=muon's
matrices and AdamW's rest are.

`Grouped` is the one optimizer the strategy holds: one list of param groups in the rules' order and one state, which
each part's optimizer shares (the same group dicts, the same state), so that a checkpoint holds one state dict,
the learning-rate schedule sets every group's rate, and a resume under another strategy or world size reads it back
as any optimizer's.
"""

from __future__ import annotations

from typing import Any

import torch

TARGET = "_target_"
"""The key of a group (a rule's) that names the optimizer class stepping it."""


class Grouped(torch.optim.Optimizer):
    """`main(groups without a _target_, **kwargs)`, and for each class a group names, that class over its groups
    (with the group's keys, its own defaults for the rest); stepped together."""

    def __init__(self, groups: list[dict[str, Any]], main: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        from launcher.base.targets import locate

        by_target: dict[str, list[dict[str, Any]]] = {}
        for group in groups:
            by_target.setdefault(str(group.get(TARGET) or ""), []).append(group)
        self.parts = [(locate(t) if t else main)(gs, **({} if t else kwargs)) for t, gs in by_target.items()]
        super().__init__(groups, {})  # the same dicts, in the rules' order, each part's defaults filled in
        self.owners = [
            next(i for i, part in enumerate(self.parts) if any(g is own for own in part.param_groups))
            for g in self.param_groups
        ]
        self._share()

    def _share(self) -> None:
        """Each part steps its own groups of this optimizer's list, over this optimizer's state."""
        for i, part in enumerate(self.parts):
            part.param_groups = [g for g, owner in zip(self.param_groups, self.owners, strict=True) if owner == i]
            part.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: shared again
        self._share()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self.parts[0].step(closure)  # the closure evaluated once, by the first part (torch's contract)
        for part in self.parts[1:]:
            part.step()
        return loss
