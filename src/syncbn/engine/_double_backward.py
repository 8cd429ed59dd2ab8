"""The engine's backward with ``create_graph=True``: itself differentiable (docs/internals/engine.md).

The collective is handed in (``reduce(tensor, phase)``): this module does no communication itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["Reduce", "differentiable_backward", "differentiable_input_grads", "reduce_unwrapped"]

Reduce = Callable[[Tensor, str], Tensor]


class _DifferentiableSum(torch.autograd.Function):
    """A sum over the group whose adjoint is itself, so gradients of any order flow across ranks."""

    @staticmethod
    def forward(tensor: Tensor, reduce: Reduce, phase: str) -> Tensor:  # type: ignore[override]
        return reduce(tensor.detach().contiguous().clone(), phase)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.reduce, ctx.phase = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        summed: Tensor = _DifferentiableSum.apply(grad, ctx.reduce, ctx.phase)
        return summed, None, None


def reduce_unwrapped(tensor: Tensor, reduce: Reduce) -> Tensor:
    """``reduce(tensor, "backward")`` on the plain tensor under torch.func's wrappers (a Function unwraps)."""
    summed: Tensor = _DifferentiableSum.apply(tensor, reduce, "backward")
    return summed


def differentiable_input_grads(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, stats: Any, reduce: Reduce
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)``, differentiable in ``x``, ``weight`` and ``grad_output``.

    The statistics are rebuilt from a differentiable sum of ``[sum x, sum x^2]``: the forward's
    values (``stats``, a :class:`syncbn.engine._math.Stats`) with the rebuild's derivatives.
    """
    mean, var, eps, total = stats.mean, stats.var, stats.eps, stats.total
    stat = mean.dtype
    dims = [0, *range(2, x.dim())]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    n: float | Tensor = total.to(torch.float64) if isinstance(total, Tensor) else float(total)
    x64 = x.to(torch.float64)
    sums = torch.stack([x64.sum(dims), (x64 * x64).sum(dims)])
    s, q = _DifferentiableSum.apply(sums, reduce, "forward (recomputed for double backward)").unbind(0)
    mean_d = s / n
    var_d = q / n - mean_d * mean_d
    mean_v = (mean.to(torch.float64) + (mean_d - mean_d.detach())).to(stat)
    var_v = (var.to(torch.float64) + (var_d - var_d.detach())).to(stat)
    invstd = (var_v + eps).rsqrt()
    xhat = (x.to(stat) - mean_v.view(shape)) * invstd.view(shape)
    dy = grad_output.to(stat)
    sum_dy = dy.sum(dims)
    sum_dy_xhat = (dy * xhat).sum(dims)
    local = torch.stack([sum_dy, sum_dy_xhat])
    reduced = _DifferentiableSum.apply(
        local.float() if local.dtype in (torch.float16, torch.bfloat16) else local, reduce, "backward"
    ).to(stat)
    scale = invstd if weight is None else invstd * weight.to(stat)
    grad_input = scale.view(shape) * (dy - reduced[0].view(shape) / n - xhat * (reduced[1].view(shape) / n))
    return grad_input.to(x.dtype), sum_dy_xhat, sum_dy


def differentiable_backward(
    ctx: Any, grad_output: Tensor, x: Tensor, weight: Tensor | None, reduce: Reduce
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The engine's backward with ``create_graph=True`` from its ``ctx``, each gradient where needed."""
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    gi, gw, gb = differentiable_input_grads(grad_output, x, weight, ctx.stats, reduce)
    if ctx.correction is not None:
        gw, gb = ctx.family.parameter_grads(gb, gw, *ctx.correction)
    return (
        gi if need_input else None,
        gw.to(ctx.param_dtype) if need_weight else None,
        gb.to(ctx.param_dtype) if need_bias else None,
    )
