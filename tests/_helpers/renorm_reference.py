"""Batch Renormalization's formulas (Ioffe, 2017) on a whole batch, in plain torch: the reference."""

from __future__ import annotations

from torch import Tensor

EPS = 1e-5


def renorm_reference(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    r_max: float,
    d_max: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The issue's formulas on the global batch: ``(y, new running_mean, new running_var)``, momentum 0.1."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(dims)
    var = x.var(dims, unbiased=False)
    s_b = (var + EPS).sqrt()
    s = (running_var + EPS).sqrt()
    r = (s_b / s).clamp(1 / r_max, r_max).detach()
    d = ((mean - running_mean) / s).clamp(-d_max, d_max).detach()
    y = weight.view(shape) * ((x - mean.view(shape)) / s_b.view(shape) * r.view(shape) + d.view(shape))
    y = y + bias.view(shape)
    n = x.numel() // x.shape[1]
    unbiased = var.detach() * n / (n - 1)
    return y, 0.9 * running_mean + 0.1 * mean.detach(), 0.9 * running_var + 0.1 * unbiased
