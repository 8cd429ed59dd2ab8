"""The fused floor of ``syncbn bench`` and ``benchmarks/speed/``: what a fused-kernel syncbn could reach.

syncbn's algorithm needs, per layer and pass, the work before the collective (forward: local
moments and their packing; backward: the sums of ``g`` and ``g * xhat``), the collective, and
the work after it (forward: unpacking, normalisation and the running update; backward: the
input gradient). A compiled implementation would do each side in one kernel. :class:`FusedBound`
stands a native kernel of at least the same passes over memory in for each of those four
kernels, inside a minimal autograd function with the layer's two real collectives, so that
timing it measures what such an implementation would cost on this machine: dispatch, Python,
the collectives and the ranks' lockstep included, the algorithm's extra small operations
excluded.

* before the forward collective: ``batch_norm_update_stats`` (two reads of ``x``);
* after it: the native inference normalisation (a read of ``x``, a write of the output) and
  ``rsqrt`` of the variance (kept for backward);
* before the backward collective: the native reduction of ``g`` and ``g * xhat``;
* after it: the native training-mode input gradient (which reduces ``g`` and ``g * xhat``
  again before writing ``dx``: more than a fused kernel would do).

The statistics are each rank's own (what is summed is not used): the numbers stay those of a
real batch norm, so a training loop around it behaves, but the result is not synchronised. A
benchmark aid, not a layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import groups

__all__ = ["TAGS", "FusedBound", "FusedBoundBatchNorm2d", "collective_buffers"]

#: The frame tags of a layer's forward and backward sums (one fixed layer identity).
TAGS = (groups.Tag(7, groups.PHASE_FORWARD), groups.Tag(7, groups.PHASE_BACKWARD))


class FusedBound(torch.autograd.Function):
    """One native kernel either side of each collective: see the module docstring."""

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
