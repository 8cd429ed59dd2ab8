"""The training layer as traced operations around the one opaque collective, for ``torch.compile``. One
Function for every family; why its backward is explicit: docs/internals/engine.md."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _accumulating
from ..families._arith import as_dtype
from ..families._protocol import THIS_CALL
from ..groups import PHASE_BACKWARD, PHASE_FORWARD
from . import _function, _math, _ops, _rules
from ._double_backward import _layout


def traced_moments(
    x: Tensor, group: int, token: Tensor | None, stat: torch.dtype, statistics: Any = THIS_CALL
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(count, mean, biased var, unbiased var)`` over the group (``group`` 0: alone), pooled, traced."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count > 0:
        acc = _math.accumulation_dtype(x.dtype)
        var_l, mean_l = torch.var_mean(as_dtype(x, acc), _layout(x)[0], correction=0)
        mean64, var64 = as_dtype(mean_l, torch.float64), as_dtype(var_l, torch.float64)
        head = torch.ones(1, dtype=torch.float64, device=x.device)
        packed = torch.cat([head, mean64, var64 + mean64 * mean64]) * count
    else:
        packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
    if not group and count == 1:
        raise _function._expected_more_than_one(x, _function.LOCAL, None)
    flags = _ops.CHECK_ONE_VALUE if count < 2 else 0
    summed = _ops._all_reduce_op(packed, group, token, PHASE_FORWARD, x, flags) if group else packed
    summed = summed if statistics is THIS_CALL else statistics.pool(summed)
    total = summed[0]
    n = total.clamp(min=1.0)
    sums = summed[1:].view(2, channels) / n
    mean64 = sums[0]
    var64 = (sums[1] - mean64 * mean64).clamp(min=0.0)
    unbiased = var64 * (total / (total - 1.0).clamp(min=1.0))
    return total, as_dtype(mean64, stat), as_dtype(var64, stat), as_dtype(unbiased, stat)


def traced_update_running(params: _function.Params, mean: Tensor, unbiased: Tensor, total: Tensor) -> None:
    """``params``' running-statistics update, traced: weight ``momentum * (N > 0)``, no host read."""
    running_mean, running_var = params.running_mean, params.running_var
    if running_mean is None and running_var is None:
        return
    weight_t = (total > 0).to(mean.dtype) * params.momentum
    for running, batch in ((running_mean, mean), (running_var, unbiased)):
        if running is not None:
            running.lerp_(as_dtype(batch, running.dtype), as_dtype(weight_t, running.dtype))


def _traced_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, params: _function.Params) -> Any:
    """:class:`_TracedSyncBatchNorm`'s forward, traced operations only: ``(out, mean, var, unbiased, total,
    invstd, weight, bias, correction)`` (``total`` ``None``: constant statistics)."""
    eps, family, running_mean = params.eps, params.family, params.running_mean
    stat = _rules.statistics_dtype(x, weight, running_mean)
    total = unbiased = None
    if family.training:
        total, mean, var, unbiased = traced_moments(x, params.group, params.layer, stat, params.statistics)
    else:  # constant statistics: the running ones (the layer has them)
        assert running_mean is not None and params.running_var is not None
        mean, var = running_mean.to(stat), params.running_var.to(stat)
    invstd = torch.rsqrt(var + eps)
    out, weight, bias, correction = family.traced_forward(x, weight, bias, mean, var, invstd, eps)
    return out, mean, var, unbiased, total, invstd, weight, bias, correction


class _TracedSyncBatchNorm(torch.autograd.Function):
    """Training batch norm of any family over a group, traceable; no running update. ``(out, mean,
    unbiased_var, count)``, ``var`` too where :attr:`saves_output`, only ``out`` differentiable; constant
    statistics: ``out``."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: _function.Params
    ) -> Any:  # type: ignore[override]
        family, token = params.family, params.layer
        if family.saves_output:  # written over a copy, which traced_inplace_abn writes over x (see there)
            x = x.clone()
        out, mean, var, unbiased, total, invstd, weight, bias, corr = _traced_forward(x, weight, bias, params)
        # Tensors only (checkpointed regions refuse None): ctx.present marks the optional ones saved.
        ctx.eps, ctx.family, ctx.group = params.eps, family, params.group
        ctx.present = (total is not None, weight is not None, bias is not None, token is not None)
        extra = [t for t in (total, weight, bias, token, *(corr or ())) if t is not None]
        ctx.save_for_backward(out if family.saves_output else x, mean, invstd, *extra)
        ctx.param_dtype = _rules.gradient_dtype(weight, bias, mean)
        if total is None:  # constant statistics
            return out
        outs = (out, mean, unbiased, total, var) if family.saves_output else (out, mean, unbiased, total)
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: Tensor, *unused: Any
    ) -> tuple[Tensor | None, ...]:
        saved, mean, invstd, *extra = ctx.saved_tensors
        total, weight, bias, token = [extra.pop(0) if present else None for present in ctx.present]
        family, correction = ctx.family, tuple(extra) or None  # the family's correction, if any
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        dims, shape = _layout(saved)
        # the gradient at the normalisation, xhat, and the scale w * invstd: the family's
        g, xhat, scale = family.traced_grad_terms(saved, grad_output, weight, bias, mean, invstd, ctx.eps)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        grad_input = None
        if need_input:
            if total is None:  # constant statistics
                grad_input = g * scale
            else:
                summed = torch.stack([sum_dy, sum_dy_xhat])
                if ctx.group:
                    summed = _ops._all_reduce_op(summed, ctx.group, token, PHASE_BACKWARD, grad_output, 0)
                n = as_dtype(total.clamp(min=1.0), g.dtype)
                mean_dy = (summed[0] / n).view(shape)
                mean_dy_xhat = (summed[1] / n).view(shape)
                grad_input = scale * (g - mean_dy - xhat * mean_dy_xhat)
            grad_input = as_dtype(grad_input, saved.dtype)
        sum_dy_xhat, sum_dy = family.parameter_grads(sum_dy, sum_dy_xhat, weight, correction)
        grad_weight = as_dtype(sum_dy_xhat, ctx.param_dtype) if need_weight else None
        grad_bias = as_dtype(sum_dy, ctx.param_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None


def sync_batch_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, params: _function.Params
) -> Tensor:
    """Training-mode synchronised batch norm of any family, traced, with the running update; ``params.family``
    is its ``snapshot`` (a renorm's ``(r, d)`` from the statistics before the update)."""
    out, mean, unbiased, total = _TracedSyncBatchNorm.apply(x, weight, bias, params)
    _accumulating.observe(params.running_mean, total, mean, unbiased, params.momentum, unbiased=True)
    traced_update_running(params, mean, unbiased, total)  # (syncbn.accumulation observed it above)
    return out


def traced_inplace_abn(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, params: _function.Params
) -> Tensor:
    """The compiled form of :func:`syncbn.functional.inplace_abn_apply`; returns ``x``, overwritten: with
    grad on, by a recorded ``x.copy_`` of the Function's new output (``mark_dirty`` on a graph input
    passes the gradient through on torch 2.13, pytorch/pytorch#184113)."""
    if torch.is_grad_enabled():
        result = _TracedSyncBatchNorm.apply(x, weight, bias, params)
        x.copy_(result if isinstance(result, Tensor) else result[0])
        result = x if isinstance(result, Tensor) else (x, *result[1:])
    else:  # the same operations, no autograd state
        _, mean, var, unbiased, total, *_ = _traced_forward(x, weight, bias, params)
        result = x if total is None else (x, mean, unbiased, total, var)
    if not params.family.training:  # eval: the output alone
        return result
    out, mean, unbiased, total, var = result
    if params.group:  # syncbn.accumulation (local layers are seen by its forward hooks)
        _accumulating.observe(params.running_mean, total, mean, var, params.momentum)
    with torch.no_grad():
        traced_update_running(params, mean, unbiased, total)
    return out
