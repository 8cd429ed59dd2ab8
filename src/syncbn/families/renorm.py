"""Batch Renormalization (Ioffe, 2017) as a family: its math only.

``y = weight * ((x - mean_B) / s_B * r + d) + bias``, with ``r`` and ``d`` constants of the step
from the running statistics before its update: batch norm with the effective affine map
``(weight * r, bias + weight * d)``. Derivation in docs/internals/engine.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import Tensor


class Renorm(NamedTuple):
    """One training call's renorm parameters: the clamps and the running statistics before the update."""

    r_max: float
    d_max: float
    running_mean: Tensor | None
    running_var: Tensor | None

    @property
    def in_place(self) -> bool:
        """Not written over the input (see :class:`syncbn.families.inplace_abn.InPlaceABN`)."""
        return False

    def snapshot(self, copy: Callable[[Tensor], Tensor]) -> Renorm:
        """This object with ``copy`` of the running statistics (traced graphs update them in place)."""
        if self.running_mean is None or self.running_var is None:
            return self
        return self._replace(
            running_mean=copy(self.running_mean.detach()), running_var=copy(self.running_var.detach())
        )

    def correction(self, mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
        """``(r, d)`` in ``mean``'s dtype, or ``None`` without running statistics (``r = 1, d = 0``)."""
        if self.running_mean is None or self.running_var is None:
            return None
        dtype = mean.dtype
        running_mean = self.running_mean.detach().to(dtype)
        inv_s = (self.running_var.detach().to(dtype) + eps).rsqrt()
        r = ((var + eps).sqrt() * inv_s).clamp(1.0 / self.r_max, self.r_max)
        d = ((mean - running_mean) * inv_s).clamp(-self.d_max, self.d_max)
        return r, d

    @staticmethod
    def affine(weight: Tensor | None, bias: Tensor | None, r: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        """The effective ``(weight * r, bias + weight * d)`` (``weight`` 1 and ``bias`` 0 when absent)."""
        if weight is None:
            w_eff, shift = r, d
        else:
            w = weight.detach()
            w_eff, shift = Renorm.scale(w, r), (w * d.to(w.dtype))
        b_eff = shift if bias is None else bias.detach() + shift.to(bias.dtype)
        return w_eff, b_eff

    @staticmethod
    def scale(weight: Tensor | None, r: Tensor) -> Tensor:
        """The effective scale ``weight * r``, differentiable in ``weight`` (``r`` a constant of the step).

        The double backward's (:mod:`syncbn.engine._double_backward`): the input gradient
        ``weight * r * invstd * (...)`` then reaches ``weight`` (gradient penalties train it).
        """
        return r if weight is None else weight * r.to(weight.dtype)

    @staticmethod
    def parameter_grads(sum_dy: Tensor, sum_dy_xhat: Tensor, r: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        """``(dweight, dbias) = (r * sum(dy * xhat) + d * sum(dy), sum(dy))``."""
        return r.to(sum_dy.dtype) * sum_dy_xhat + d.to(sum_dy.dtype) * sum_dy, sum_dy
