"""Batch norm as a family: ``y = (x - mean) / sqrt(var + eps) * weight + bias``, its math only."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._arith import as_dtype, backward_sums, broadcast_shape, input_grad, normalize
from ._protocol import Record

VMAP = (
    "syncbn: torch.func.vmap over a synchronised SyncBatchNorm in training is not supported "
    "(each vmapped sample would need its own collective across ranks). Use the layer in eval "
    "mode, or outside a process group, under vmap; torch.func.grad/vjp/jacrev are supported."
)


def _compute_dtype(x: Tensor, stat: torch.dtype) -> torch.dtype:
    """The dtype traced elementwise work runs in: the statistics' or the input's, whichever is wider."""
    return torch.promote_types(torch.promote_types(x.dtype, stat), torch.float32)


class BatchNorm:
    """One training call of batch norm (stateless: :data:`BATCH_NORM` is the one instance)."""

    __slots__ = ()
    training = True
    saves_output = False
    second_order = True
    members = "ranks of the group"
    double_backward_error = ""

    def snapshot(self, copy: Callable[[Tensor], Tensor]) -> Any:
        return self

    def check_input(self, x: Tensor) -> None:
        """Raise before anything changes where the family cannot run on ``x`` (batch norm: never)."""

    def correction(self, mean: Tensor, var: Tensor, eps: float) -> Any:
        """The family's constants of the step from the statistics (``None``: the plain map)."""
        return None

    def affine(self, weight: Any, bias: Any, *correction: Tensor) -> tuple[Any, Any]:
        """The effective ``(weight, bias)`` under ``correction``."""
        return weight, bias

    def alone(
        self, x: Tensor, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float,
        eps: float, engine: Callable[[], Tensor],
    ) -> Tensor | None:  # fmt: skip
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)

    def native_forward(
        self, x: Tensor, weight: Any, bias: Any, params: Any, stat: torch.dtype
    ) -> Record | None:
        return None

    def forward(self, x: Tensor, weight: Any, bias: Any, m: Record, out: Tensor | None) -> Record:
        """``normalize`` with ``m``'s statistics (the family's effective map), into ``out`` if given."""
        correction = self.correction(m.mean, m.var, m.eps)
        if correction is not None:  # from the statistics before the running update
            weight, bias = self.affine(weight, bias, *correction)
        if m.local_count > 0:
            out = normalize(x, weight, bias, m.mean, m.var, m.eps, out=out)
        elif out is None:
            out = torch.empty_like(x)
        return Record(
            m.mean, m.var, m.eps, m.total, m.local_count, m.unbiased, m.global_count, out, weight, correction
        )

    def grad_sums(
        self, x: Tensor, grad: Tensor, weight: Any, bias: Any, record: Record, need_input: bool
    ) -> tuple[Any, Tensor, Tensor]:
        """This member's ``(None, sum(dy), sum(dy * xhat))``; zeros for an empty local batch."""
        if record.local_count > 0:
            return (None, *backward_sums(grad, x, weight, record.mean, record.var, record.eps))
        zeros = torch.zeros(x.shape[1], dtype=record.mean.dtype, device=x.device)
        return None, zeros, zeros.clone()

    def input_grad(
        self, x: Tensor, grad: Tensor, weight: Any, bias: Any, record: Record, carry: Any, reduced: Any
    ) -> Tensor:
        """From the group-summed ``reduced`` (``(2, C)``); zeros for an empty local batch."""
        if record.local_count == 0:
            return torch.zeros_like(x)
        if not (x.is_cpu and reduced.is_cpu) and reduced.device != x.device:  # DataParallel: on replica 0's
            reduced = reduced.to(x.device)
        return input_grad(grad, x, weight, record, reduced)

    def parameter_grads(
        self, sum_dy: Tensor, sum_dy_xhat: Tensor, weight: Any, correction: Any
    ) -> tuple[Any, Any]:
        return sum_dy_xhat, sum_dy

    def differentiable_weight(self, weight: Any, correction: Any) -> Any:
        return weight

    def traced_forward(
        self, x: Tensor, weight: Any, bias: Any, mean: Tensor, var: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Any, Any, Any]:
        correction = self.correction(mean, var, eps)
        if correction is not None:  # the family's effective affine map; (r, d) constants
            weight, bias = self.affine(weight, bias, *correction)
        shape, comp = broadcast_shape(x), _compute_dtype(x, mean.dtype)
        scale = invstd if weight is None else invstd * weight
        y = (as_dtype(x, comp) - as_dtype(mean, comp).view(shape)) * as_dtype(scale, comp).view(shape)
        if bias is not None:
            y = y + as_dtype(bias, comp).view(shape)
        return as_dtype(y, x.dtype), weight, bias, correction

    def traced_grad_terms(
        self, x: Tensor, grad: Tensor, weight: Any, bias: Any, mean: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        shape, comp = broadcast_shape(x), _compute_dtype(x, mean.dtype)
        xhat = (as_dtype(x, comp) - as_dtype(mean, comp).view(shape)) * as_dtype(invstd, comp).view(shape)
        scale = as_dtype(invstd if weight is None else invstd * weight, comp).view(shape)
        return as_dtype(grad, comp), xhat, scale

    def vmap_error(self, batched_input: bool, batched_parameters: bool) -> str:
        return VMAP


BATCH_NORM = BatchNorm()
