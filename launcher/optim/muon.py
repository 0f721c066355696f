"""optim=muon: Muon over the 2-D hidden matrices, AdamW over every other parameter (embeddings, the output head,
norms, biases), in one optimizer whose param groups say which update each takes (`MUON`).

Muon's update of a matrix is the orthogonalised momentum of its whole gradient (Newton-Schulz), which no shard can
compute from its own rows. Under FSDP/HSDP (DTensor parameters) each rank gathers the matrix's momentum, computes the
orthogonalisation of the whole matrix (the same input on every rank, so the same result), and applies the rows it
holds: the update of one process, at any world size. Under DDP each rank holds the whole matrix already. The
iteration runs in fp32 by default, so that layouts that sum gradients in another order agree to fp32's rounding;
`ns_dtype="bf16"` runs it as torch.optim.Muon does (faster on GPUs, 8 significant bits).

Each update is torch's own arithmetic, in torch's order: Muon's matrices take `torch.optim.Muon`'s (with
`adjust_lr_fn="original"`), the other groups `torch.optim.AdamW`'s single-tensor step, so that the two torch optimizers
over the same groups give the same weights bit for bit (tests/test_muon.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

MUON = "muon"
"""The param-group key marking Muon's groups (the hidden matrices)."""
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients, as torch.optim.Muon has them."""
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""optim.ns_dtype: the dtype the Newton-Schulz iteration runs in (torch.optim.Muon's own is bf16)."""


def orthogonalised(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: str = "fp32") -> torch.Tensor:
    """The Newton-Schulz orthogonalisation torch.optim.Muon computes (`_zeropower_via_newtonschulz`), in `dtype`'s
    arithmetic (NS_DTYPES), returned in it."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(NS_DTYPES[dtype])
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a DTensor (every rank gathers it), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mine(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `whole` that `like` holds: its DTensor shard (sliced here, no communication), or all of it."""
    if not hasattr(like, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked `MUON` (2-D matrices: momentum, Nesterov, whole-matrix orthogonalisation, the
    shape's learning-rate adjustment of torch.optim.Muon), AdamW (decoupled weight decay, bias correction) for the
    others. `lr` is AdamW's; Muon's groups take `muon_lr` (scaled with the schedule like every group's lr)."""

    HIDDEN_MATRICES = MUON
    """The param-group key `launcher.optim.build` marks the hidden matrices' group with."""

    def __init__(
        self,
        params: Any,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        muon_lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "fp32",
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {ns_dtype!r}; one of {', '.join(NS_DTYPES)}")
        for name, value in (("lr", lr), ("muon_lr", muon_lr), ("weight_decay", weight_decay), ("eps", eps)):
            if value < 0:
                raise ValueError(f"Invalid {name}: {value}")
        if not 0.0 <= momentum < 1.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid momentum or betas: {momentum}, {betas}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            muon_lr=muon_lr,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        self.on_gather: Callable[[torch.Tensor], None] | None = None
        """Told of each whole matrix gathered from its shards (a strategy's communication counter)."""
        for group in self.param_groups:
            if group.get(MUON):
                bad = [tuple(p.shape) for p in group["params"] if p.dim() != 2]
                if bad:
                    raise ValueError(f"Muon takes 2-D matrices only; its group holds parameters of shape {bad[0]}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (self._muon if group.get(MUON) else self._adamw)(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - group["momentum"])  # as torch.optim.Muon
        update = p.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
        rows, cols = p.shape
        lr = group["lr"] * math.sqrt(max(1.0, rows / cols))  # torch.optim.Muon's "original" adjustment
        whole = _whole(update)
        if whole is not update and self.on_gather is not None:
            self.on_gather(whole)
        ortho = _mine(orthogonalised(whole, group["ns_steps"], dtype=group["ns_dtype"]), p)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(ortho.to(p.dtype), alpha=-lr)

    def _adamw(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's single-tensor step (`torch.optim.adam._single_tensor_adam`), operation for operation."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        (beta1, beta2), t, lr = group["betas"], float(state["step"]), group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denominator = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denominator, value=-lr / (1 - beta1**t))
