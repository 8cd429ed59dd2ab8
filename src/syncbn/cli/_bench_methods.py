"""What ``syncbn bench`` times besides syncbn and ``torch.nn.SyncBatchNorm`` (docs/internals/cli.md).

The naive algorithm, local BatchNorm with syncbn's two collectives in place, a loopback group
and the forced-sync wrappers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce

from ..engine._function import Params, SyncBatchNormFunction
from ..groups import ProcessGroupSum
from ..modules import SyncBatchNorm
from ._bench_floor import collective_buffers

__all__ = ["METHODS", "LocalWithCollectives", "LoopbackGroup", "NaiveSyncBatchNorm", "build"]

METHODS = ("local", "2xAR", "2xAR-shm", "local+AR", "syncbn", "alone", "syncbn-pg", "naive", "torch")


class LoopbackGroup:
    """A two-member :class:`~syncbn.groups.SumGroup` whose sum is the identity.

    Runs syncbn's whole synchronised code path in one process; the statistics are the local
    batch's, so the result equals ``nn.BatchNorm``'s.
    """

    size = 2
    rank = 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


class NaiveSyncBatchNorm(nn.Module):
    """The common naive synchronised batch norm, for comparison only.

    Per-channel mean and mean of squares in the input dtype, averaged over ranks by an
    autograd-aware ``all_reduce`` (ranks weighted equally: right for equal batches only),
    ``var = E[x^2] - E[x]^2``, and normalisation by broadcasting arithmetic.
    """

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


class _CollectivesAround(torch.autograd.Function):
    """Identity that all-reduces ``fwd`` in forward and ``bwd`` in backward."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, fwd: Tensor, bwd: Tensor) -> Tensor:  # type: ignore[override]
        if dist.is_initialized():
            dist.all_reduce(fwd)
        ctx.bwd = bwd
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        if dist.is_initialized():
            dist.all_reduce(ctx.bwd)
        return grad, None, None


class LocalWithCollectives(nn.Module):
    """Local ``nn.BatchNorm`` plus syncbn's two all-reduces at the same points (the real floor)."""

    def __init__(self, bn: nn.Module, channels: int, device: torch.device) -> None:
        super().__init__()
        self.bn = bn
        self.fwd, self.bwd = collective_buffers(channels, device, torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _CollectivesAround.apply(self.bn(x), self.fwd, self.bwd)
        return out


def _local_bn(dim: int, channels: int) -> nn.Module:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(dim, nn.BatchNorm3d)(channels)


class _ForcedSync(nn.Module):
    """Run ``kind``'s synchronised autograd function directly, even on a group of one.

    ``kind``: ``"syncbn"`` (the default group) or ``"torch"``.
    """

    def __init__(self, bn: nn.Module, kind: str) -> None:
        super().__init__()
        self.bn = bn
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        bn: Any = self.bn
        if self.kind != "torch":
            params = Params(bn.running_mean, bn.running_var, bn.eps, bn.momentum, ProcessGroupSum())
            return SyncBatchNormFunction.apply(x, bn.weight, bn.bias, params)  # type: ignore[no-any-return]
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFn

        return TorchSyncFn.apply(  # type: ignore[no-untyped-call, no-any-return]
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, dist.group.WORLD, 1
        )


def build(method: str, x: Tensor, force_sync: bool) -> nn.Module | None:
    """The module timed as ``method`` on input like ``x``; ``None`` where the method cannot run."""
    channels = x.shape[1]
    if method == "local":
        mod: nn.Module = _local_bn(x.dim(), channels)
    elif method == "local+AR":
        mod = LocalWithCollectives(_local_bn(x.dim(), channels), channels, x.device)
    elif method == "syncbn":
        mod = SyncBatchNorm(channels)
    elif method == "alone":  # syncbn's whole synchronised path, no collective, no peer
        mod = SyncBatchNorm(channels, process_group=LoopbackGroup())
    elif method == "syncbn-pg":
        if x.is_cuda or not dist.is_initialized() or force_sync:
            return None  # only CPU collectives have the shared-memory path to turn off
        mod = SyncBatchNorm(channels, process_group=ProcessGroupSum(None, shared_memory=False))
    elif method == "naive":
        mod = NaiveSyncBatchNorm(channels)
    elif method == "torch":
        if not x.is_cuda:
            return None  # torch.nn.SyncBatchNorm raises on CPU tensors
        mod = nn.SyncBatchNorm(channels)
    else:
        raise ValueError(method)
    if force_sync and method in ("syncbn", "torch"):
        mod = _ForcedSync(mod, method)
    return mod.to(device=x.device).train()
