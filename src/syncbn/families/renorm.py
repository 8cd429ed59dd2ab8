"""Batch Renormalization (Ioffe, 2017) as a family: batch norm with the effective affine map
``(weight * r, bias + weight * d)``, ``r`` and ``d`` constants of the step (docs/internals/engine.md)."""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from .batchnorm import BatchNorm


class Renorm(BatchNorm):
    """One training call's renorm parameters: the clamps and the running statistics before the update."""

    __slots__ = ("r_max", "d_max", "running_mean", "running_var")

    def __init__(self, r_max: float, d_max: float, running_mean: Tensor, running_var: Tensor) -> None:
        self.r_max, self.d_max, self.running_mean, self.running_var = r_max, d_max, running_mean, running_var

    def snapshot(self, copy: Callable[[Tensor], Tensor]) -> Renorm:
        """This object with ``copy`` of the running statistics (traced graphs update them in place)."""
        return Renorm(
            self.r_max, self.d_max, copy(self.running_mean.detach()), copy(self.running_var.detach())
        )

    def alone(self, *args: Any) -> Tensor | None:
        return None  # synchronised over the one member: the engine's statistics, then (r, d)

    def correction(self, mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``(r, d)`` in ``mean``'s dtype."""
        dtype = mean.dtype
        running_mean = self.running_mean.detach().to(dtype)
        inv_s = (self.running_var.detach().to(dtype) + eps).rsqrt()
        r = ((var + eps).sqrt() * inv_s).clamp(1.0 / self.r_max, self.r_max)
        d = ((mean - running_mean) * inv_s).clamp(-self.d_max, self.d_max)
        return r, d

    def affine(
        self, weight: Tensor | None, bias: Tensor | None, *correction: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The effective ``(weight * r, bias + weight * d)`` (``weight`` 1 and ``bias`` 0 when absent)."""
        r, d = correction
        if weight is None:
            w_eff, shift = r, d
        else:
            w = weight.detach()
            w_eff, shift = self.differentiable_weight(w, correction), (w * d.to(w.dtype))
        b_eff = shift if bias is None else bias.detach() + shift.to(bias.dtype)
        return w_eff, b_eff

    def differentiable_weight(self, weight: Tensor | None, correction: Any) -> Tensor:
        """The effective scale ``weight * r``, differentiable in ``weight`` (``r`` a constant of the step):
        the double backward's input gradient ``weight * r * invstd * (...)`` then reaches ``weight``."""
        r = correction[0]
        return r if weight is None else weight * r.to(weight.dtype)

    def parameter_grads(
        self, sum_dy: Tensor, sum_dy_xhat: Tensor, weight: Any, correction: Any
    ) -> tuple[Any, Any]:
        """``(dweight, dbias) = (r * sum(dy * xhat) + d * sum(dy), sum(dy))``."""
        r, d = correction
        return r.to(sum_dy.dtype) * sum_dy_xhat + d.to(sum_dy.dtype) * sum_dy, sum_dy
