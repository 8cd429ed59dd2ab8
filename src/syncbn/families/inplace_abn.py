"""In-place activated batch norm (InPlace-ABN, Rota Bulò et al., CVPR 2018) as a family: its math only.

``y = act(xhat * (|w| + eps) + b)`` is written over the input; backward recovers ``z = act^-1(y)``
and ``xhat`` from ``y`` alone. docs/memory.md gives the math and its conditioning,
docs/internals/engine.md how the gradients are evaluated. 16-bit outputs are recovered in float32.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._errors import ChannelCountError
from . import _arith
from ._protocol import Record

DOUBLE_BACKWARD = (
    "syncbn: double backward (create_graph=True) through an in-place activated batch norm "
    "(InPlaceABN/InPlaceABNSync/InPlaceSyncBatchNorm) is not supported: its backward recovers its "
    "input from the output it overwrote, which is not differentiable again. Use syncbn.SyncBatchNorm "
    "followed by the activation (or the non-in-place ABN) where second derivatives are needed."
)

ACTIVATIONS = ("leaky_relu", "elu", "identity")

VMAP = (
    "syncbn: torch.func.vmap over an in-place activated batch norm (InPlaceSyncBatchNorm, "
    "InPlaceABN, InPlaceABNSync) expected eval mode with running statistics and an unbatched "
    "weight and bias (got {got}): batch statistics would be each vmapped sample's own (and, "
    "synchronised, a collective per sample). Under vmap use the layer in eval mode, or "
    "syncbn.SyncBatchNorm followed by the activation; torch.func.grad/vjp/jacrev are supported."
)


def check_activation(activation: str, param: float, *, in_place: bool = True) -> None:
    """Raise ``ValueError`` for an activation the (in-place) layer cannot use.

    ``"relu"`` only when not ``in_place``; in place, ``param`` (slope or alpha) must be positive and
    finite. The layers call it at construction and at every forward (the attributes may change).
    """
    if activation in ACTIVATIONS:
        if in_place and activation != "identity":
            try:
                valid = 0 < float(param) < float("inf")
            except (TypeError, ValueError):
                valid = False
            if not valid:
                what = "negative slope" if activation == "leaky_relu" else "alpha"
                raise ValueError(
                    f"expected a positive, finite activation_param (the {what} of {activation}) for the "
                    f"in-place layer, which inverts the activation in backward (got {param!r})"
                )
        return
    allowed = ACTIVATIONS if in_place else ("relu", *ACTIVATIONS)
    names = ", ".join(map(repr, allowed))
    if activation == "relu" and in_place:
        raise ValueError(
            "activation='relu' cannot be computed in place: ReLU maps every negative value to 0, so "
            "the input cannot be recovered from the output for backward. Use 'leaky_relu' (a small "
            "slope, e.g. 0.01), 'elu' or 'identity', or the non-in-place ABN class for ReLU "
            f"(expected one of {names}, got 'relu')"
        )
    if activation not in allowed:
        raise ValueError(f"expected activation one of {names} (got {activation!r})")


def check_writable(x: Tensor, what: str) -> None:
    """Raise before anything changes when ``x`` cannot be overwritten (under autograd, or at all)."""
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise RuntimeError(
            f"{what} overwrites its input, which here is a leaf tensor that requires grad (a parameter "
            "or an input created with requires_grad=True): autograd forbids writing over it. Pass the "
            "output of another operation (e.g. the convolution before it), or a clone"
        )
    if not x.is_contiguous() and any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape)):
        raise RuntimeError(
            f"{what} overwrites its input, which here has several elements in one memory location "
            f"(size {list(x.shape)}, stride {list(x.stride())}: an expand()ed or broadcast tensor): "
            "each output value needs its own element. Pass a tensor that owns its elements, e.g. "
            "x.contiguous() or x.clone()"
        )


def check_call(
    x: Tensor, weight: Tensor | None, running_mean: Tensor | None, running_var: Tensor | None, training: bool
) -> None:
    """Raise ``ValueError`` (or :func:`check_writable`'s error) for a call the layer cannot run."""
    if x.dim() < 2:
        raise ValueError(f"expected an input of at least 2 dimensions (N, C, *) (got {x.dim()}D input)")
    if weight is not None and weight.shape[0] != x.shape[1]:
        raise ChannelCountError(
            f"expected input with {weight.shape[0]} channels in dimension 1 "
            f"(got input of size {list(x.shape)})"
        )
    if not training and (running_mean is None or running_var is None):
        raise ValueError("expected running_mean and running_var when training=False (got None)")
    check_writable(x, "in-place activated batch norm")


def abs_scale(weight: Tensor | None, eps: float) -> Tensor | None:
    """The per-channel scale ``|w| + eps`` of the in-place layers (``None`` without a weight: scale 1)."""
    return None if weight is None else weight.detach().abs() + eps


def affine_coefficients(
    scale: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(a, c)``, ``a = s * invstd`` and ``c = b - mean * a``: ``x * a + c`` goes into the activation."""
    a = (var + eps).rsqrt()
    if scale is not None:
        a = a * _arith.cast(scale, a.dtype)
    c = -mean * a
    if bias is not None:
        c = c + _arith.cast(bias.detach(), c.dtype)
    return a, c


def activate_(x: Tensor, a: Tensor | None, c: Tensor | None, activation: str, param: float) -> Tensor:
    """``x <- activation(x * a + c)`` in place (per-channel ``a``, ``c``; ``None``: none); returns ``x``."""
    if a is not None and c is not None:
        shape = _arith.broadcast_shape(x)
        if x.dtype in _arith._LOW_PRECISION:  # one rounding: two 16-bit ones flip signs near 0 (the branch)
            torch.addcmul(c.view(shape), x, a.view(shape), out=x)
        else:  # two passes: an addcmul with a broadcast first operand is several times slower on CPU
            x.mul_(a.view(shape)).add_(c.view(shape))
    if activation == "leaky_relu":
        F.leaky_relu(x, float(param), inplace=True)
    elif activation == "elu":
        F.elu(x, float(param), inplace=True)
    elif activation == "relu":
        F.relu(x, inplace=True)
    return x


def recover(y: Tensor, grad: Tensor, activation: str, param: float) -> tuple[Tensor, Tensor, bool]:
    """``(z, dz, scratch)``: the activation's input and its gradient, recovered from ``y`` (never written).

    In the accumulation dtype; ``scratch``: whether ``z`` is a new tensor the caller may overwrite.
    """
    acc = _arith.accumulation_dtype(y.dtype)
    p = float(param)
    widen = y.dtype != acc
    yw = y.to(acc) if widen else y
    gw = _arith.cast(grad, acc)
    if activation == "leaky_relu":
        dz = torch.ops.aten.leaky_relu_backward(gw, yw, p, True)
        # The inverse of leaky_relu(., p), in place where ``yw`` is a widened copy.
        return F.leaky_relu(yw, 1.0 / p, inplace=widen), dz, True
    if activation == "elu":
        dz = torch.ops.aten.elu_backward(gw, p, 1.0, 1.0, True, yw)
        # log1p(y / alpha) where y < 0, kept finite where saturated (y == -alpha).
        inner = torch.div(yw, p).clamp_(min=-1.0 + torch.finfo(acc).eps).log1p_()
        if torch._C._are_functorch_transforms_active():  # (vmap has no rule for where's out= form)
            return torch.where(yw < 0, inner, yw), dz, True
        return torch.where(yw < 0, inner, yw, out=inner), dz, True
    return yw, gw, widen


def recovered_sums(dz: Tensor, z: Tensor, scale: Tensor | None, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Local ``(sum(dz), sum(dz * xhat))``: batch norm's backward kernel with mean ``b``, variance ``s^2``."""
    channels = z.shape[1]  # (z - b) / sqrt(s^2) = xhat; b 0 and s 1 when absent
    mean = z.new_zeros(channels) if bias is None else _arith.cast(bias.detach(), z.dtype)
    var = z.new_ones(channels) if scale is None else _arith.cast(scale, z.dtype).square()
    if torch._C._are_functorch_transforms_active():  # (vmap has no rule for the kernel's eval form)
        dims, shape = [0, *range(2, z.dim())], _arith.broadcast_shape(z)
        return dz.sum(dims), (dz * (z - mean.view(shape))).sum(dims) * var.rsqrt()
    _, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
        dz, z, None, mean, var, None, None, False, 0.0, [False, True, True]
    )
    return sum_dz, sum_dz_xhat


class InPlaceABN(NamedTuple):
    """One call of the in-place family: its activation and parameter, train or eval; scale ``|w| + eps``."""

    activation: str
    param: float
    training: bool = True

    # The protocol's questions (syncbn.families._protocol.Family): written over the input, whose
    # output it saves; its backward recovers the input from the output, once.
    saves_output: bool = True
    second_order: bool = False
    members: str = "member(s) of the group"
    double_backward_error: str = DOUBLE_BACKWARD

    def snapshot(self, copy: Callable[[Tensor], Tensor]) -> InPlaceABN:
        return self

    def check_input(self, x: Tensor) -> None:
        check_writable(x, "in-place activated batch norm")

    def alone(self, *args: Any) -> Tensor | None:
        """One member: the engine without a collective (``nn.BatchNorm``'s kernel, then the activation)."""
        return args[-1]()  # type: ignore[no-any-return]

    def forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, m: Record, out: Any) -> Record:
        """``x <- act(x * a + c)`` with ``m``'s mean and biased variance, the global batch's in
        training, the running ones in eval (see :func:`affine_coefficients`)."""
        eps = m.eps
        if m.local_count > 0:
            a, c = affine_coefficients(abs_scale(weight, eps), bias, m.mean, m.var, eps)
            activate_(x, a, c, self.activation, self.param)
        invstd = (m.var + eps).rsqrt()
        return Record(
            m.mean,
            m.var,
            eps,
            m.total,
            m.local_count,
            out=x,
            weight=weight,
            invstd=invstd,
            training=self.training,
        )

    def native_forward(
        self, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Any, stat: torch.dtype
    ) -> Record:
        """Without a group: ``nn.BatchNorm``'s own training kernel over ``x``, then the activation."""
        running_mean, running_var, momentum, eps = (
            params.running_mean,
            params.running_var,
            params.momentum,
            params.eps,
        )
        scale = abs_scale(weight, eps)
        b = None if bias is None else bias.detach()
        # On a contiguous or channels-last x the CPU kernel reads each value before writing over it.
        if x.device.type == "cpu" and _arith.memory_format(x) is not None:
            invstd = torch.empty(x.shape[1], dtype=stat)
            torch.ops.aten.native_batch_norm.out(
                x, scale, b, running_mean, running_var, True, momentum, eps,
                out=x, save_mean=torch.empty_like(invstd), save_invstd=invstd,
            )  # fmt: skip
        else:  # (any other layout, e.g. t[:, ::2]: it would read values it already wrote)
            out, _, invstd = torch.native_batch_norm(
                x, scale, b, running_mean, running_var, True, momentum, eps
            )
            x.copy_(out)
        activate_(x, None, None, self.activation, self.param)
        count = x.numel() // x.shape[1]
        return Record(None, None, eps, float(count), count, out=x, weight=weight, invstd=invstd, native=True)

    def grad_sums(
        self,
        y: Tensor,
        grad: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        stats: Record,
        need_input: bool,
    ) -> tuple[Any, Tensor, Tensor]:
        """``(carry, sum(dz), sum(dz * xhat))`` from ``y``; ``carry`` (``None``: empty) feeds input_grad
        (after the one-kernel forward: the input gradient itself, see :meth:`native_backward`)."""
        if stats.native:
            return self.native_backward(y, grad, weight, bias, stats, need_input)
        if stats.local_count == 0:
            zeros = torch.zeros(y.shape[1], dtype=_arith.accumulation_dtype(y.dtype), device=y.device)
            return None, zeros, zeros.clone()
        z, dz, scratch = recover(y, grad, self.activation, self.param)
        sum_dz, sum_dz_xhat = recovered_sums(dz, z, abs_scale(weight, stats.eps), bias)
        return (z, dz, scratch), sum_dz, sum_dz_xhat

    def input_grad(
        self, y: Tensor, grad: Tensor, weight: Tensor | None, bias: Tensor | None, stats: Record, carry: Any,
        reduced: Tensor | None,
    ) -> Tensor:  # fmt: skip
        """The input gradient in ``y``'s dtype from :meth:`grad_sums`' ``carry`` and the global ``reduced``.

        Evaluated as ``z * B + C + dz * A`` (docs/internals/engine.md); eval (no ``reduced``): ``a * dz``.
        """
        if stats.native:  # computed with the sums
            return carry  # type: ignore[no-any-return]
        if carry is None:  # an empty local batch
            return torch.zeros_like(y)
        z, dz, scratch = carry
        acc, scale, dtype = z.dtype, abs_scale(weight, stats.eps), y.dtype
        shape = _arith.broadcast_shape(z)
        s = torch.ones_like(stats.invstd, dtype=acc) if scale is None else _arith.cast(scale, acc)
        a = s * _arith.cast(stats.invstd, acc)
        if reduced is None:
            return torch.mul(dz, a.view(shape)).to(dtype)
        n = stats.total if isinstance(stats.total, float) else stats.total.to(acc)
        sums = _arith.cast(reduced.to(z.device), acc)
        b_coef = -a / s * sums[1] / n
        c_coef = -a * sums[0] / n
        if bias is not None:
            c_coef = c_coef - b_coef * _arith.cast(bias.detach(), acc)
        out = z.mul_(b_coef.view(shape)) if scratch else torch.mul(z, b_coef.view(shape))
        out.add_(c_coef.view(shape)).addcmul_(dz, a.view(shape))
        return out if out.dtype == dtype else out.to(dtype)

    def native_backward(
        self,
        y: Tensor,
        grad: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        stats: Record,
        need_input: bool,
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """Without a group: ``(grad_input, sum(dz), sum(dz * xhat))`` in ONE native batch-norm backward call.

        Saved mean ``b``, saved invstd ``1/s`` and weight ``s^2 * invstd`` make it the in-place layer's.
        """
        z, dz, _ = recover(y, grad, self.activation, self.param)
        acc, eps = z.dtype, stats.eps
        scale = abs_scale(weight, eps)
        s = torch.ones_like(stats.invstd, dtype=acc) if scale is None else _arith.cast(scale, acc)
        mean = torch.zeros_like(s) if bias is None else _arith.cast(bias.detach(), acc)
        w = s * s * _arith.cast(stats.invstd, acc)
        grad_input, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
            dz, z, w, None, None, mean, s.reciprocal(), True, eps, [need_input, True, True]
        )
        if grad_input is not None and grad_input.dtype != y.dtype:
            grad_input = grad_input.to(y.dtype)
        return grad_input if need_input else None, sum_dz, sum_dz_xhat

    def differentiable_weight(self, weight: Any, correction: Any) -> Any:
        return weight  # (no double backward: second_order is False)

    @staticmethod
    def parameter_grads(
        sum_dz: Tensor, sum_dz_xhat: Tensor, weight: Tensor | None, correction: Any
    ) -> tuple[Tensor, Tensor]:
        """``(dweight, dbias) = (sign(w) * sum(dz * xhat), sum(dz))``: ``d|w|/dw`` is -1 where ``w < 0``."""
        if weight is None:
            return sum_dz_xhat, sum_dz
        return torch.where(weight.detach() < 0, -sum_dz_xhat, sum_dz_xhat), sum_dz

    # The traced twins (syncbn.engine._compiled): plain tensor operations, no host reads or reused buffers.

    def traced_forward(
        self, x: Tensor, weight: Any, bias: Any, mean: Tensor, var: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Any, Any, Any]:
        """:meth:`forward` in traced operations: ``x <- act(x * a + c)``; ``x`` is the output."""
        a = invstd if weight is None else invstd * (weight.abs() + eps).to(invstd.dtype)
        c = -mean * a if bias is None else bias.to(a.dtype) - mean * a
        shape = _arith.broadcast_shape(x)
        with torch.no_grad():
            x.copy_(x * a.view(shape) + c.view(shape))
            activate_(x, None, None, self.activation, self.param)
        return x, weight, bias, None

    def traced_grad_terms(
        self, y: Tensor, grad: Tensor, weight: Any, bias: Any, mean: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dz, xhat, a)`` recovered from ``y``, traced: batch norm's ``(dy, xhat, w * invstd)``."""
        acc = _arith.accumulation_dtype(y.dtype)
        shape, p = _arith.broadcast_shape(y), self.param
        yw, g = y.to(acc), grad.to(acc)
        if self.activation == "leaky_relu":
            negative = yw < 0
            z = torch.where(negative, yw / p, yw)
            dz = torch.where(negative, g * p, g)
        elif self.activation == "elu":
            z = torch.where(yw < 0, torch.log1p((yw / p).clamp(min=-1.0 + torch.finfo(acc).eps)), yw)
            dz = torch.where(yw <= 0, g * (yw + p), g)
        else:
            z, dz = yw, g
        scale = torch.ones_like(invstd) if weight is None else (weight.abs() + eps).to(invstd.dtype)
        shift = torch.zeros_like(invstd) if bias is None else bias.to(invstd.dtype)
        xhat = (z - shift.to(acc).view(shape)) / scale.to(acc).view(shape)
        return dz, xhat, (scale * invstd).to(acc).view(shape)

    def vmap_error(self, batched_input: bool, batched_parameters: bool) -> str:
        got = "batch statistics (training, or eval without running statistics)"
        if not self.training:
            got = "a batched weight or bias" if batched_input else "an unbatched input"
        return VMAP.format(got=got)
