"""The autograd function of in-place activated synchronised batch norm (InPlace-ABN).

Forward (training, over a group): local moments of ``x``, packed as the
SyncBatchNorm forward packs them (:func:`syncbn._math.pack_moments`), ONE
framed ``all_reduce`` over the group (:func:`syncbn._function._all_reduce`),
then ``x <- act(x * a + c)`` written over the input (``a = (|w| + eps) *
invstd``, ``c = b - mean * a``) and marked dirty. Without a group (or a group
of one): ``nn.BatchNorm``'s own training kernel, written over the input, then
the activation in place. Eval: the running statistics, no communication.

Saved for backward: the output (which the next layer keeps anyway) and
per-channel vectors (``invstd``; the weight and bias are the layer's
parameters). Backward recovers the activation's input ``z`` and its gradient
from the output (:func:`syncbn._abn_math.recover`), sums ``[sum dz,
sum dz*xhat]`` locally, ONE framed ``all_reduce``, and finishes the input
gradient as batch norm does (locally: one native batch-norm backward call).
Weight and bias gradients stay local (DDP sums them): ``d|w|/dw`` is -1 where
``w < 0``, else +1.

Double backward is refused with an error (the recovered ``xhat`` is not a
differentiable function of the saved output the way the forward's was).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from . import _abn_math, _math
from ._function import (
    _all_reduce,
    checks_before_backward,
    checks_before_forward,
    one_value_error,
    statistics_dtype,
    synchronized_moments,
)
from .groups import SumGroup

__all__ = ["ABNStats", "InPlaceABNFunction", "abn_backward", "abn_forward", "inplace_abn_apply"]

DOUBLE_BACKWARD = (
    "syncbn: double backward (create_graph=True) through an in-place activated batch norm "
    "(InPlaceABN/InPlaceABNSync/InPlaceSyncBatchNorm) is not supported: its backward recovers its "
    "input from the output it overwrote, which is not differentiable again. Use syncbn.SyncBatchNorm "
    "followed by the activation (or the non-in-place ABN) where second derivatives are needed."
)


class ABNStats(NamedTuple):
    """What a forward computed and its backward needs (besides the output)."""

    invstd: Tensor  # 1 / sqrt(var + eps), var the global batch's (statistics dtype) or the running one
    total: float | Tensor  # global count (a float on CPU; 0-dim tensor on a device); 0.0 in eval
    local_count: int  # this member's values per channel
    training: bool


def abn_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    param: float,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
) -> ABNStats:
    """Write ``act((x - mean) * invstd * (|w| + eps) + b)`` over ``x``; update the running statistics.

    Args:
        x: the local input ``(N, C, *)``, overwritten with the output.
        weight: the weight (scale ``|w| + eps``) or ``None`` (scale 1).
        bias: the bias or ``None``.
        running_mean: updated in place in training unless ``None``; used in eval.
        running_var: likewise (unbiased variance).
        training: batch statistics (``True``) or the running ones.
        momentum: the running-statistics factor.
        eps: added to the variance, and to ``|w|``.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
        param: the slope or alpha.
        reduce: sums the packed moments over the group (``None``: local).
        one_value_error: builds the error for a global count of one.

    Returns:
        The statistics backward needs. Nothing is changed before the one-value error.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    stat_dtype = statistics_dtype(x, weight, running_mean)
    scale = _abn_math.abs_scale(weight, eps)
    if not training:
        assert running_mean is not None and running_var is not None
        mean, var = _math.cast(running_mean, stat_dtype), _math.cast(running_var, stat_dtype)
        if count > 0:
            a, c = _abn_math.affine_coefficients(scale, bias, mean, var, eps)
            _abn_math.activate_(x, a, c, activation, param)
        return ABNStats((var + eps).rsqrt(), 0.0, count, False)
    host = x.device.type == "cpu"
    if reduce is None and count > 1:
        # Local: nn.BatchNorm's own training kernel (statistics, normalisation, running update in
        # one call), copied over the input, then the activation in place.
        b = None if bias is None else bias.detach()
        if host:  # the CPU kernel reads the statistics first, then writes element by element: in place
            stat = statistics_dtype(x, weight, running_mean)
            invstd = torch.empty(channels, dtype=stat)
            torch.ops.aten.native_batch_norm.out(
                x, scale, b, running_mean, running_var, True, momentum, eps,
                out=x, save_mean=torch.empty_like(invstd), save_invstd=invstd,
            )  # fmt: skip
        else:
            out, _, invstd = torch.native_batch_norm(
                x, scale, b, running_mean, running_var, True, momentum, eps
            )
            x.copy_(out)
        _abn_math.activate_(x, None, None, activation, param)
        return ABNStats(invstd, float(count), count, True)

    moments = synchronized_moments(x, stat_dtype, reduce, one_value_error)
    if count > 0:
        a, c = _abn_math.affine_coefficients(scale, bias, moments.mean, moments.var, eps)
        _abn_math.activate_(x, a, c, activation, param)
    moments.update_running(running_mean, running_var, momentum)
    return ABNStats((moments.var + eps).rsqrt(), moments.total, count, True)


def local_sums(
    y: Tensor,
    grad: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    param: float,
    stats: ABNStats,
) -> tuple[tuple[Tensor, bool] | None, Tensor | None, Tensor, Tensor]:
    """``((z, scratch), dz, sum_dz, sum_dz_xhat)`` of one member (``None``s for an empty batch).

    ``z`` is the activation's input recovered from ``y``; see :func:`syncbn._abn_math.recover`.
    """
    if stats.local_count == 0:
        acc = _math.accumulation_dtype(y.dtype)
        zeros = torch.zeros(y.shape[1], dtype=acc, device=y.device)
        return None, None, zeros, zeros.clone()
    scale = _abn_math.abs_scale(weight, eps)
    z, dz, scratch = _abn_math.recover(y, grad, activation, param)
    sum_dz, sum_dz_xhat = _abn_math.recovered_sums(dz, z, scale, bias)
    return (z, scratch), dz, sum_dz, sum_dz_xhat


def finish_grads(
    y: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    stats: ABNStats,
    recovered: tuple[Tensor, bool] | None,
    dz: Tensor | None,
    sum_dz: Tensor,
    sum_dz_xhat: Tensor,
    reduced: Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad_input, grad_weight, grad_bias)`` from one member's recovered tensors and the summed sums."""
    grad_input = None
    if needs[0]:
        if recovered is None or dz is None:
            grad_input = torch.zeros_like(y)
        else:
            z, scratch = recovered
            scale = _abn_math.abs_scale(weight, eps)
            grad_input = _abn_math.input_grad(
                z, dz, scratch, scale, bias, stats.invstd, stats.total, reduced, y.dtype
            )
    grad_weight = grad_bias = None
    if weight is not None and needs[1]:
        w = weight.detach()
        signed = torch.where(w < 0, -sum_dz_xhat.to(w.dtype), sum_dz_xhat.to(w.dtype))
        grad_weight = signed
    if bias is not None and needs[2]:
        grad_bias = sum_dz.to(bias.dtype)
    return grad_input, grad_weight, grad_bias


def abn_backward(
    y: Tensor,
    grad: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    param: float,
    stats: ABNStats,
    reduce: Callable[[Tensor], Tensor] | None,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of one member; ``reduce`` sums the ``(2, C)`` backward sums (training, input grad)."""
    if reduce is None and stats.training and stats.local_count > 1:
        return _local_backward(y, grad, weight, bias, eps, activation, param, stats, needs)
    recovered, dz, sum_dz, sum_dz_xhat = local_sums(y, grad, weight, bias, eps, activation, param, stats)
    reduced = None
    if stats.training and needs[0]:
        reduced = _math.pack_grad_sums(sum_dz, sum_dz_xhat)
        if reduce is not None:
            reduced = reduce(reduced)
    return finish_grads(y, weight, bias, eps, stats, recovered, dz, sum_dz, sum_dz_xhat, reduced, needs)


def _local_backward(
    y: Tensor,
    grad: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    param: float,
    stats: ABNStats,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Local training backward: ONE native batch-norm backward call on the recovered ``z``.

    Batch norm's training backward of ``z`` with saved mean ``b``, saved invstd
    ``1/s`` (so its ``xhat`` is ``(z - b) / s``) and weight ``s^2 * invstd`` (so
    its scale is ``s * invstd``) is exactly the in-place layer's: input gradient,
    ``sum(dz * xhat)`` and ``sum(dz)`` in one pass over memory.
    """
    z, dz, _ = _abn_math.recover(y, grad, activation, param)
    acc = z.dtype
    scale = _abn_math.abs_scale(weight, eps)
    s = torch.ones_like(stats.invstd, dtype=acc) if scale is None else _math.cast(scale, acc)
    mean = torch.zeros_like(s) if bias is None else _math.cast(bias.detach(), acc)
    w = s * s * _math.cast(stats.invstd, acc)
    grad_input, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
        dz, z, w, None, None, mean, s.reciprocal(), True, eps, [needs[0], True, True]
    )
    if grad_input is not None and grad_input.dtype != y.dtype:
        grad_input = grad_input.to(y.dtype)
    grad_weight = grad_bias = None
    if weight is not None and needs[1]:
        wd = weight.detach()
        grad_weight = torch.where(wd < 0, -sum_dz_xhat, sum_dz_xhat).to(wd.dtype)
    if bias is not None and needs[2]:
        grad_bias = sum_dz.to(bias.dtype)
    return grad_input if needs[0] else None, grad_weight, grad_bias


class InPlaceABNFunction(torch.autograd.Function):
    """In-place activated batch norm over ``group`` (``None``: this process alone); output is ``x``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        training: bool,
        momentum: float,
        eps: float,
        activation: str,
        param: float,
        group: SumGroup | None,
        layer: Any = None,
    ) -> Tensor:
        call = 0
        reduce = None
        size = 1
        if training and group is not None:
            call = checks_before_forward(group, layer, x)
            size = group.size

            def reduce(packed: Tensor) -> Tensor:
                return _all_reduce(group, packed, layer, "forward")

        stats = abn_forward(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            training,
            momentum,
            eps,
            activation,
            param,
            reduce,
            lambda: one_value_error(x, size, "member(s) of the group", layer),
        )
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias)
        ctx.stats = stats
        ctx.eps, ctx.activation, ctx.param = eps, activation, param
        ctx.group, ctx.layer, ctx.call = group, layer, call
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        y, weight, bias = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        group, layer = ctx.group, ctx.layer
        reduce = None
        if ctx.stats.training and group is not None:
            checks_before_backward(group, layer, grad, ctx.call)

            def reduce(sums: Tensor) -> Tensor:
                return _all_reduce(group, sums, layer, "backward")

        grads = abn_backward(
            y,
            grad,
            weight,
            bias,
            ctx.eps,
            ctx.activation,
            ctx.param,
            ctx.stats,
            reduce,
            needs,  # type: ignore[arg-type]
        )
        return (*grads, None, None, None, None, None, None, None, None, None)


def check_writable(x: Tensor, what: str) -> None:
    """Raise before anything changes when ``x`` cannot be overwritten under autograd."""
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise RuntimeError(
            f"{what} overwrites its input, which here is a leaf tensor that requires grad (a parameter "
            "or an input created with requires_grad=True): autograd forbids writing over it. Pass the "
            "output of another operation (e.g. the convolution before it), or a clone"
        )


def inplace_abn_apply(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    param: float,
    group: SumGroup | None,
    layer: Any = None,
) -> Tensor:
    """Run :class:`InPlaceABNFunction` (checks first); returns ``x``, overwritten with the output."""
    if x.dim() < 2:
        raise ValueError(f"expected an input of at least 2 dimensions (N, C, *) (got {x.dim()}D input)")
    if weight is not None and weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"expected input with {weight.shape[0]} channels in dimension 1 "
            f"(got input of size {list(x.shape)})"
        )
    if not training and (running_mean is None or running_var is None):
        raise ValueError("expected running_mean and running_var when training=False (got None)")
    check_writable(x, "in-place activated batch norm")
    out: Tensor = InPlaceABNFunction.apply(
        x, weight, bias, running_mean, running_var, training, momentum, eps, activation, param, group, layer
    )
    return out
