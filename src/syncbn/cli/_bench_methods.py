"""What ``syncbn bench`` times besides syncbn and ``torch.nn.SyncBatchNorm`` (docs/internals/cli.md):
the naive algorithm, a loopback group (syncbn alone) and the fused floor (a fused-kernel syncbn's best).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce

from .. import groups
from ..modules import SyncBatchNorm

__all__ = [
    "METHODS",
    "TAGS",
    "FusedBound",
    "FusedBoundBatchNorm2d",
    "LoopbackGroup",
    "NaiveSyncBatchNorm",
    "build",
    "collective_buffers",
]

METHODS = ("local", "2xAR", "syncbn", "alone", "naive", "torch")


class LoopbackGroup:
    """A two-member :class:`~syncbn.groups.SumGroup` whose sum is the identity: syncbn's whole
    synchronised path in one process, with the local batch's statistics (``nn.BatchNorm``'s result)."""

    size = 2
    rank = 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


class NaiveSyncBatchNorm(nn.Module):
    """The common naive synchronised batch norm, for comparison only: ``E[x]``, ``E[x^2]`` in the input
    dtype averaged over ranks (equal weights: right for equal batches only), ``var = E[x^2] - E[x]^2``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        world = dist.get_world_size() if dist.is_initialized() else 1
        mean = x.mean(dims)
        meansq = (x * x).mean(dims)
        stats = torch.cat([mean, meansq])
        if world > 1:
            stats = all_reduce(stats) / world  # torch's autograd-aware sum: backward sums too
        mean, meansq = stats.split(channels)
        var = meansq - mean * mean
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        shift = self.bias - mean * scale
        with torch.no_grad():
            n = x.numel() // channels * world
            running_mean, running_var = self.get_buffer("running_mean"), self.get_buffer("running_var")
            running_mean.lerp_(mean.detach().to(running_mean.dtype), self.momentum)
            unbiased = var.detach() * (n / max(n - 1, 1))
            running_var.lerp_(unbiased.to(running_var.dtype), self.momentum)
        return x * scale.view(shape) + shift.view(shape)


def _local_bn(dim: int, channels: int) -> nn.Module:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(dim, nn.BatchNorm3d)(channels)


def build(method: str, x: Tensor) -> nn.Module | None:
    """The module timed as ``method`` on input like ``x``; ``None`` where the method cannot run."""
    channels = x.shape[1]
    if method == "local":
        mod: nn.Module = _local_bn(x.dim(), channels)
    elif method == "syncbn":
        mod = SyncBatchNorm(channels)
    elif method == "alone":  # syncbn's whole synchronised path, no collective, no peer
        mod = SyncBatchNorm(channels, process_group=LoopbackGroup())
    elif method == "naive":
        mod = NaiveSyncBatchNorm(channels)
    elif method == "torch":
        if not x.is_cuda:
            return None  # torch.nn.SyncBatchNorm raises on CPU tensors
        mod = nn.SyncBatchNorm(channels)
    else:
        raise ValueError(method)
    return mod.to(device=x.device).train()


#: The frame tags of a layer's forward and backward sums (one fixed layer identity).
TAGS = (groups.Tag(7, groups.PHASE_FORWARD), groups.Tag(7, groups.PHASE_BACKWARD))


class FusedBound(torch.autograd.Function):
    """``batch_norm_update_stats``, sum, inference normalisation; backward reduction, sum, input gradient. The
    floor: at least a fused kernel's passes over memory around each of a layer's two real collectives. The
    statistics are each rank's own (what is summed is unused): a benchmark aid."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor,
        eps: float,
        group: groups.ProcessGroupSum,
        buffers: tuple[Tensor, Tensor],
    ) -> Tensor:
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        group.all_reduce_sum(buffers[0], TAGS[0])
        out = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, var, torch.rsqrt(var + eps))
        ctx.eps, ctx.group, ctx.buffer = eps, group, buffers[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var, invstd = ctx.saved_tensors
        _, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, mean, var, None, None, False, ctx.eps, [False, True, True]
        )
        ctx.group.all_reduce_sum(ctx.buffer, TAGS[1])
        grad_input, _, _ = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, None, None, mean, invstd, True, ctx.eps, [True, False, False]
        )
        return grad_input, grad_weight, grad_bias, None, None, None


def collective_buffers(
    channels: int, device: Any = None, backward_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The forward (``2C + 1`` float64) and backward (``2C``, float32 by default) buffers a layer sums."""
    fwd = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    return fwd, torch.zeros(2 * channels, dtype=backward_dtype, device=device)


class FusedBoundBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training forward is :class:`FusedBound` over ``group``.

    Args:
        num_features: channels.
        group: the group the two sums go over (e.g. ``syncbn.groups.ProcessGroupSum()``).
    """

    def __init__(self, num_features: int, group: Any) -> None:
        super().__init__(num_features)
        self.group = group
        self.sums: tuple[Tensor, Tensor] | None = None  # made on the input's device at the first call

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        if self.sums is None or self.sums[0].device != input.device:
            self.sums = collective_buffers(self.num_features, input.device)
        out: Tensor = FusedBound.apply(input, self.weight, self.bias, self.eps, self.group, self.sums)
        return out
