"""The engine's backward with ``create_graph=True``, itself differentiable; the collective handed in."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

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
        return _DifferentiableSum.apply(grad, ctx.reduce, ctx.phase), None, None


def reduce_unwrapped(tensor: Tensor, reduce: Reduce) -> Tensor:
    """``reduce(tensor, "backward")`` on the plain tensor under torch.func's wrappers (a Function unwraps)."""
    return _DifferentiableSum.apply(tensor, reduce, "backward")


def _layout(x: Tensor) -> tuple[list[int], list[int]]:
    """The dimensions a per-channel sum of ``x`` reduces, and the shape a per-channel vector takes."""
    return [0, *range(2, x.dim())], [1, x.shape[1]] + [1] * (x.dim() - 2)


def _normalised(
    x: Tensor, stats: Any, summed: Tensor, pooled: bool = False
) -> tuple[Tensor, Tensor, float | Tensor]:
    """``(xhat, invstd, n)``: the forward's values (``stats``) with the derivatives of ``summed``;
    ``pooled``: ``stats`` count constant sums too (the variance's derivative centres on their mean)."""
    mean, var, eps, total = stats.mean, stats.var, stats.eps, stats.total
    stat = mean.dtype
    n: float | Tensor = total.to(torch.float64) if isinstance(total, Tensor) else float(total)
    s, q = summed.to(mean.device).unbind(0)
    mean_d = s / n
    centre = mean_d + (mean.to(torch.float64) - mean_d.detach()) if pooled else mean_d
    var_d = q / n - centre * centre
    mean_v = (mean.to(torch.float64) + (mean_d - mean_d.detach())).to(stat)
    var_v = (var.to(torch.float64) + (var_d - var_d.detach())).to(stat)
    invstd = (var_v + eps).rsqrt()
    shape = _layout(x)[1]
    return (x.to(stat) - mean_v.view(shape)) * invstd.view(shape), invstd, n


def joint_input_grads(
    grads: list[Tensor],
    xs: list[Tensor],
    weights: list[Tensor | None],
    stats: list[Any],
    total: Callable[[list[Tensor], str], Tensor],
    pooled: bool = False,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Each member's ``(grad_input, grad_weight, grad_bias)``, differentiable in ``x``, ``weight``, ``dy``;
    ``total(parts, phase)`` sums the members' tensors, differentiably."""
    moments = []  # [sum x, sum x^2] per channel, float64, differentiable in x
    for x in xs:
        x64, dims = x.to(torch.float64), _layout(x)[0]
        moments.append(torch.stack([x64.sum(dims), (x64 * x64).sum(dims)]))
    summed = total(moments, "forward (recomputed for double backward)")
    terms, local = [], []  # local: each member's [sum dy, sum dy * xhat] (float32 at least)
    for g, x, st in zip(grads, xs, stats):
        xhat, invstd, n = _normalised(x, st, summed, pooled)
        dy, dims = g.to(xhat.dtype), _layout(x)[0]
        sums = torch.stack([dy.sum(dims), (dy * xhat).sum(dims)])
        local.append(sums.float() if sums.dtype in (torch.float16, torch.bfloat16) else sums)
        terms.append((dy, xhat, invstd, n))
    reduced = total(local, "backward")
    grads_out = []
    for x, weight, (dy, xhat, invstd, n), part in zip(xs, weights, terms, local):
        shape = _layout(x)[1]
        r = reduced.to(device=xhat.device, dtype=xhat.dtype)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        grad_input = scale.view(shape) * (dy - r[0].view(shape) / n - xhat * (r[1].view(shape) / n))
        grads_out.append((grad_input.to(x.dtype), part[1], part[0]))
    return grads_out


def replica_total(parts: list[Tensor], phase: str) -> Tensor:
    """The DataParallel replicas' differentiable sum, in replica order on the first's device."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part.to(out.device)
    return out


def differentiable_backward(
    ctx: Any, grad_output: Tensor, x: Tensor, weight: Tensor | None, reduce: Reduce, pooled: bool = False
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The engine's backward with ``create_graph=True`` from its ``ctx``, each gradient where needed."""
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]

    def total(parts: list[Tensor], phase: str) -> Tensor:
        return _DifferentiableSum.apply(parts[0], reduce, phase)

    ((gi, gw, gb),) = joint_input_grads([grad_output], [x], [weight], [ctx.record], total, pooled)
    gw, gb = ctx.family.parameter_grads(gb, gw, weight, ctx.record.correction)
    return (
        gi if need_input else None,
        gw.to(ctx.param_dtype) if need_weight else None,
        gb.to(ctx.param_dtype) if need_bias else None,
    )
