"""The autograd function that joins the math (:mod:`syncbn._math`) to a group.

One ``all_reduce`` in forward (packed moments, ``2C + 1`` float64 values) and
one in backward (``2C`` float64 values) per call, whatever the world size.

Device-to-host synchronisation: none when this rank holds at least two values
per channel, because the global count is then known to be at least two without
looking. Only a rank holding zero or one value per channel reads the global
count back (``.item()``), to decide between an empty batch, the "more than one
value per channel" error and the normal path. Every rank whose global count is
below two is such a rank, so all of them take the same decision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _checks, _math
from .groups import CollectiveError, SumGroup

__all__ = ["SyncBatchNormFunction", "statistics_dtype"]


def statistics_dtype(x: Tensor, weight: Tensor | None, running_mean: Tensor | None) -> torch.dtype:
    """The dtype normalisation statistics are handed to the native kernels in.

    The layer's parameter dtype when it has parameters or buffers (so a float32
    layer fed float16 input keeps float32 statistics), else float32 or float64
    after the input.
    """
    if weight is not None:
        return weight.dtype
    if running_mean is not None:
        return running_mean.dtype
    return _math.accumulation_dtype(x.dtype)


def _expected_more_than_one(x: Tensor, group: SumGroup, layer: Any) -> ValueError:
    return ValueError(
        "Expected more than 1 value per channel when training, got 1 value per channel "
        f"across the {group.size} ranks of the group ("
        + ("" if layer is None else f"layer {_checks.layer_name(layer)}; ")
        + f"this rank's input size {list(x.shape)})"
    )


def _all_reduce(group: SumGroup, tensor: Tensor, layer: Any, phase: str) -> Tensor:
    try:
        return group.all_reduce_sum(tensor)
    except CollectiveError as exc:
        raise exc.for_layer(_checks.layer_name(layer), phase) from exc.__cause__


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm whose statistics span every member of ``group``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: SumGroup,
        layer: Any = None,
    ) -> Tensor:
        call = _checks.before_forward(group, layer, x)
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        if count > 0:
            mean_l, m2_l = _math.local_moments(x)
            packed = _math.pack_moments(count, mean_l, m2_l, channels=channels, device=x.device)
        else:
            packed = _math.pack_moments(0, None, None, channels=channels, device=x.device)
        packed = _all_reduce(group, packed, layer, "forward")
        total, mean64, var64, unbiased64 = _math.unpack_moments(packed, channels)

        global_count = 2  # a lower bound is all that is needed when count >= 2
        if count < 2:
            global_count = int(total.item())
            if global_count == 1:
                raise _expected_more_than_one(x, group, layer)

        stat_dtype = statistics_dtype(x, weight, running_mean)
        mean = mean64.to(stat_dtype)
        var = var64.to(stat_dtype)
        if count > 0:
            out = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        else:
            out = torch.empty_like(x)

        if global_count > 0:
            if running_mean is not None:
                running_mean.copy_(running_mean * (1.0 - momentum) + mean64 * momentum)
            if running_var is not None:
                running_var.copy_(running_var * (1.0 - momentum) + unbiased64 * momentum)

        ctx.save_for_backward(x, weight, mean, var, total)
        ctx.eps = eps
        ctx.count = count
        ctx.param_dtype = (
            weight.dtype if weight is not None else (bias.dtype if bias is not None else stat_dtype)
        )
        ctx.group = group
        ctx.layer = layer
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var, total = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        channels = x.shape[1]
        if ctx.count > 0:
            sum_dy, sum_dy_xhat = _math.backward_sums(grad_output, x, weight, mean, var, ctx.eps)
        else:
            sum_dy = torch.zeros(channels, dtype=mean.dtype, device=x.device)
            sum_dy_xhat = torch.zeros_like(sum_dy)

        grad_input = None
        if need_input:
            _checks.before_backward(ctx.group, ctx.layer, grad_output, ctx.call)
            reduced = _all_reduce(ctx.group, torch.cat([sum_dy, sum_dy_xhat]).double(), ctx.layer, "backward")
            if ctx.count > 0:
                grad_input = _math.input_grad(
                    grad_output,
                    x,
                    weight,
                    mean,
                    var,
                    ctx.eps,
                    total,
                    reduced[:channels],
                    reduced[channels:],
                )
            else:
                grad_input = torch.zeros_like(x)

        grad_weight = sum_dy_xhat.to(ctx.param_dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.param_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
