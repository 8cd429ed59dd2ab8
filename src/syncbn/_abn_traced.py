"""The in-place activated batch norm that ``torch.compile`` traces (no graph break).

Same math as :mod:`syncbn._abn` (statistics packed as ``[n, n*mean, n*var + n*mean^2]``
in float64, ``x <- act(x * a + c)`` in place, only the output saved, ``xhat``
recovered in backward) written with plain tensor operations only: no host
reads, no reused buffers. The statistics and the running-statistics update
are the traced engine's (:func:`syncbn._compiled.traced_moments`,
:func:`~syncbn._compiled.traced_update_running`), computed outside the autograd
function (their derivative is in its backward). Over a group (``group``, a handle of
:func:`syncbn._ops.group_handle`; 0 is local) the two collectives are the one
opaque operator ``syncbn::all_reduce_sum`` (ordered, never dropped), framed
with the layer's token: one in forward (the packed moments, with the layer's
input for the first-use handshake and the "more than 1 value per channel"
check on every rank when this rank holds fewer than two values), one in
backward. Everything else is traced, and fused by the compiler.

Locally, a count of one raises while tracing (as the eager layer); a global
count of zero leaves the running statistics unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _accumulating, _compiled, _function, _ops
from .groups import PHASE_BACKWARD

__all__ = ["traced_inplace_abn"]


def _shape(x: Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class TracedInPlaceABN(torch.autograd.Function):
    """``x <- act(xhat * (|w| + eps) + b)`` with given statistics; backward from the output alone."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        var: Tensor,
        total: Tensor | None,
        eps: float,
        activation: str,
        param: float,
        group: int,
        token: Tensor | None,
    ) -> Tensor:
        invstd = torch.rsqrt(var + eps)
        a = invstd if weight is None else invstd * (weight.abs() + eps).to(invstd.dtype)
        c = -mean * a if bias is None else bias.to(a.dtype) - mean * a
        shape = _shape(x)
        with torch.no_grad():
            x.copy_(x * a.view(shape) + c.view(shape))
            if activation == "leaky_relu":
                F.leaky_relu(x, param, inplace=True)
            elif activation == "elu":
                F.elu(x, param, inplace=True)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd, total, token)
        ctx.eps, ctx.activation, ctx.param, ctx.group = eps, activation, param, group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        y, weight, bias, invstd, total, token = ctx.saved_tensors
        eps, activation, p = ctx.eps, ctx.activation, ctx.param
        acc = _acc(y.dtype)
        shape, dims = _shape(y), _dims(y)
        yw, g = y.to(acc), grad.to(acc)
        if activation == "leaky_relu":
            negative = yw < 0
            z = torch.where(negative, yw / p, yw)
            dz = torch.where(negative, g * p, g)
        elif activation == "elu":
            negative = yw <= 0
            z = torch.where(yw < 0, torch.log1p((yw / p).clamp(min=-1.0 + torch.finfo(acc).eps)), yw)
            dz = torch.where(negative, g * (yw + p), g)
        else:
            z, dz = yw, g
        scale = torch.ones_like(invstd) if weight is None else (weight.abs() + eps).to(invstd.dtype)
        shift = torch.zeros_like(invstd) if bias is None else bias.to(invstd.dtype)
        xhat = (z - shift.to(acc).view(shape)) / scale.to(acc).view(shape)
        sums = torch.stack([dz.sum(dims), (dz * xhat).sum(dims)])
        grad_input = None
        a = (scale * invstd).to(acc).view(shape)
        if ctx.needs_input_grad[0]:
            if total is None:  # eval: the statistics are constants
                grad_input = (dz * a).to(y.dtype)
            else:
                reduced = sums
                if ctx.group:
                    reduced = _ops._all_reduce_op(sums, ctx.group, token, PHASE_BACKWARD, grad, 0)
                n = total.to(acc).clamp(min=1.0)
                mean_dz = (reduced[0] / n).view(shape)
                mean_dzx = (reduced[1] / n).view(shape)
                grad_input = (a * (dz - mean_dz - xhat * mean_dzx)).to(y.dtype)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = torch.where(weight < 0, -sums[1], sums[1]).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = sums[0].to(bias.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def traced_inplace_abn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float | Tensor,
    eps: float,
    activation: str,
    param: float,
    group: int = 0,
    token: Tensor | None = None,
) -> Tensor:
    """The compiled form of :func:`syncbn._abn.inplace_abn_apply`; returns ``x``, overwritten.

    ``group``: a :func:`syncbn._ops.group_handle` (0: local); ``token``: the layer's
    :func:`syncbn._ops.layer_token`.
    """
    stat_dtype = _function.statistics_dtype(x, weight, running_mean)
    if training:
        # The traced engine's moments and running update (syncbn._compiled), as BatchNorm's.
        total, mean, var, unbiased = _compiled.traced_moments(x.detach(), group, token, stat_dtype)
        if group:  # syncbn.accumulation (local layers are seen by its forward hooks)
            _accumulating.observe(running_mean, total, mean, var, momentum)
        with torch.no_grad():
            _compiled.traced_update_running(running_mean, running_var, mean, unbiased, total, momentum)
        out: Tensor = TracedInPlaceABN.apply(
            x, weight, bias, mean, var, total, eps, activation, param, group, token
        )
        return out
    assert running_mean is not None and running_var is not None
    mean, var = running_mean.to(stat_dtype), running_var.to(stat_dtype)
    out = TracedInPlaceABN.apply(x, weight, bias, mean, var, None, eps, activation, param, 0, None)
    return out
