"""Batch Renormalization (Ioffe, 2017) as a family: its math only.

Training, over the group's global batch (biased variance ``var_B``)::

    s_B = sqrt(var_B + eps)              s = sqrt(running_var + eps)
    r = clamp(s_B / s, 1 / r_max, r_max) d = clamp((mean_B - running_mean) / s, -d_max, d_max)
    y = weight * ((x - mean_B) / s_B * r + d) + bias

``r`` and ``d`` come from the running statistics *before* the step's update and
are constants in backward. So the layer is batch norm with the effective affine
map ``weight' = weight * r`` and ``bias' = bias + weight * d``: the engine's
batchnorm forward, input gradient and reductions apply unchanged, and only the
parameter gradients differ::

    dweight = r * sum(dy * xhat) + d * sum(dy)      dbias = sum(dy)

With ``r_max = 1`` and ``d_max = 0`` (or without running statistics) ``r = 1``,
``d = 0``: exactly batch norm.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import Tensor

__all__ = ["Renorm"]


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
            w_eff, shift = (w * r.to(w.dtype)), (w * d.to(w.dtype))
        b_eff = shift if bias is None else bias.detach() + shift.to(bias.dtype)
        return w_eff, b_eff

    @staticmethod
    def parameter_grads(sum_dy: Tensor, sum_dy_xhat: Tensor, r: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        """``(dweight, dbias) = (r * sum(dy * xhat) + d * sum(dy), sum(dy))``."""
        return r.to(sum_dy.dtype) * sum_dy_xhat + d.to(sum_dy.dtype) * sum_dy, sum_dy
