"""Synchronised BatchNorm (`strategy.sync_batchnorm=true`): each BatchNorm layer normalises with the mean and variance
of the whole micro-batch over every rank, and its running statistics follow those, the same on every rank.

On CUDA it is torch's `SyncBatchNorm` (`convert_sync_batchnorm`). torch's needs CUDA: its forward refuses CPU
tensors, its kernels (`batch_norm_stats`, ...) have no CPU implementation and DDP refuses it in a CPU module. On CPU
ranks (gloo) the same statistics come from `AllReduceBatchNorm` instead: two differentiable all-reduces (sums, then
squared deviations), whose backward all-reduces the gradients of the statistics as torch's does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class _AllReduce(torch.autograd.Function):
    """A sum over every rank; its gradient is the sum of every rank's gradient (each rank's output uses each input)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        return out


class AllReduceBatchNorm(_BatchNorm):
    """A BatchNorm whose training statistics are those of every rank's batch together (any backend, any device)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)  # evaluation (running statistics) or one process: plain BatchNorm
        self._check_input_dim(input)
        dims, shape = [0, *range(2, input.dim())], [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        local = torch.tensor([x.numel() // x.size(1)], dtype=x.dtype, device=x.device)
        sums = _AllReduce.apply(torch.cat([x.sum(dims), local]))
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centred = x - mean.view(shape)
        var = _AllReduce.apply(centred.square().sum(dims)) / count  # biased: what normalises, as torch's
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[operator]
                factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(input.dtype)


def sync_batchnorm(model: nn.Module, device_type: str) -> nn.Module:
    """The model with every BatchNorm layer synchronised over the default process group (every rank)."""
    if device_type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if type(module) in BATCHNORMS:
            # The same module, of a class with the same state: parameters, buffers, hooks and state-dict keys stay.
            module.__class__ = AllReduceBatchNorm
    return model
