"""The arithmetic of in-place activated batch normalization, with no communication.

In-place activated batch norm (InPlace-ABN, Rota Bulò et al., CVPR 2018) writes

.. math::
    y = \\phi\\big(\\hat x\\, s + b\\big), \\qquad
    \\hat x = (x - \\mu)\\,\\text{invstd}, \\qquad s = |w| + \\epsilon

over its input and keeps only :math:`y` (and per-channel vectors) for
backward. Backward recovers what it needs from :math:`y` alone, because the
activation :math:`\\phi` is invertible and :math:`s > 0`:

.. math::
    z = \\phi^{-1}(y), \\qquad \\hat x = (z - b) / s, \\qquad
    \\frac{\\partial L}{\\partial z} = g\\,\\phi'(z),

where :math:`\\phi'` is itself a function of :math:`y`: the slope :math:`a`
where :math:`y < 0` for ``leaky_relu`` (:math:`\\phi^{-1}(y) = y / a` there),
:math:`y + \\alpha` where :math:`y \\le 0` for ``elu``
(:math:`\\phi^{-1}(y) = \\log(1 + y/\\alpha)` there). Then the input gradient is
batch norm's, with :math:`s\\,\\text{invstd}` as the scale (see
:func:`syncbn._math.input_grad`).

Conditioning: an error :math:`\\delta` in :math:`y` (its rounding to the input
dtype) becomes :math:`\\delta / s` in :math:`\\hat x` (divided by the slope too
where ``leaky_relu`` is negative): small :math:`|w|` amplifies it. ``elu``
saturates: where :math:`y \\to -\\alpha` the logarithm diverges and the
recovered :math:`\\hat x` is only known to be very negative; its weight in the
gradient, :math:`y + \\alpha`, goes to zero there, so only the
:math:`\\hat x \\sum g\\hat x / N` term of the input gradient feels it. The
argument of the logarithm is clamped at the dtype's resolution (no infinity,
no NaN).

Low-precision (float16/bfloat16) outputs are recovered in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _math

__all__ = [
    "ACTIVATIONS",
    "activate_",
    "affine_coefficients",
    "check_activation",
    "input_grad",
    "recover",
    "recovered_sums",
]

ACTIVATIONS = ("leaky_relu", "elu", "identity")


def check_activation(activation: str, param: float, *, in_place: bool = True) -> None:
    """Raise ``ValueError`` for an activation the (in-place) layer cannot use.

    Args:
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"`` (and ``"relu"``
            when ``in_place`` is false).
        param: the slope of ``leaky_relu`` or the ``alpha`` of ``elu``; must be
            positive for those two (a slope of 0 is ReLU, not invertible).
        in_place: whether the activation must be invertible.
    """
    allowed = ACTIVATIONS if in_place else ("relu", *ACTIVATIONS)
    if activation == "relu" and in_place:
        raise ValueError(
            "activation='relu' cannot be computed in place: ReLU maps every negative value to 0, so "
            "the input cannot be recovered from the output for backward. Use 'leaky_relu' (a small "
            "slope, e.g. 0.01), 'elu' or 'identity', or the non-in-place ABN class for ReLU "
            f"(expected one of {', '.join(repr(a) for a in allowed)}, got 'relu')"
        )
    if activation not in allowed:
        raise ValueError(
            f"expected activation one of {', '.join(repr(a) for a in allowed)} (got {activation!r})"
        )
    if in_place and activation in ("leaky_relu", "elu"):
        p = float(param)
        if not p > 0 or p != p or p == float("inf"):
            what = "negative slope" if activation == "leaky_relu" else "alpha"
            raise ValueError(
                f"expected a positive, finite activation_param (the {what} of {activation}) for the "
                f"in-place layer, which inverts the activation in backward (got {param!r})"
            )


def abs_scale(weight: Tensor | None, eps: float) -> Tensor | None:
    """The per-channel scale ``|w| + eps`` of the in-place layers (``None`` without a weight: scale 1)."""
    return None if weight is None else weight.detach().abs() + eps


def affine_coefficients(
    scale: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(a, c)``, ``a = s * invstd`` and ``c = b - mean * a``: ``x * a + c`` goes into the activation."""
    a = (var + eps).rsqrt()
    if scale is not None:
        a = a * _math.cast(scale, a.dtype)
    c = -mean * a
    if bias is not None:
        c = c + _math.cast(bias.detach(), c.dtype)
    return a, c


def activate_(x: Tensor, a: Tensor, c: Tensor, activation: str, param: float) -> Tensor:
    """``x <- activation(x * a + c)`` in place (per-channel ``a``, ``c``); returns ``x``.

    ``a`` and ``c`` are in the statistics dtype (at least float32): the affine
    map runs there and is rounded once into ``x``'s dtype, as ``nn.BatchNorm``.
    """
    shape = _math.broadcast_shape(x)
    torch.addcmul(c.view(shape), x, a.view(shape), out=x)
    if activation == "leaky_relu":
        F.leaky_relu(x, float(param), inplace=True)
    elif activation == "elu":
        F.elu(x, float(param), inplace=True)
    elif activation == "relu":
        F.relu(x, inplace=True)
    return x


def recover(
    y: Tensor, grad: Tensor, scale: Tensor | None, bias: Tensor | None, activation: str, param: float
) -> tuple[Tensor, Tensor]:
    """``(xhat, dz)`` recovered from the output ``y`` and its gradient ``grad``.

    Both in :func:`syncbn._math.accumulation_dtype` of ``y`` (float32 for
    16-bit outputs), both new tensors (``y`` is kept intact: the next layer
    keeps it too). ``dz`` is the gradient at the activation's input.
    """
    acc = _math.accumulation_dtype(y.dtype)
    yw = y.to(acc, copy=True)  # becomes xhat, in place
    gw = _math.cast(grad, acc)
    p = float(param)
    if activation == "leaky_relu":
        dz = torch.ops.aten.leaky_relu_backward(gw, yw, p, True)
        F.leaky_relu(yw, 1.0 / p, inplace=True)  # the inverse of leaky_relu(., p), p > 0
    elif activation == "elu":
        dz = torch.ops.aten.elu_backward(gw, p, 1.0, 1.0, True, yw)
        negative = yw < 0
        # log1p(y / alpha) where y < 0, its argument kept above -1 (a saturated output, y == -alpha).
        inner = torch.div(yw, p).clamp_(min=-1.0 + torch.finfo(acc).eps).log1p_()
        torch.where(negative, inner, yw, out=yw)
    else:
        dz = gw  # only read from here on
    shape = _math.broadcast_shape(y)
    if scale is None:
        inv = torch.ones(y.shape[1], dtype=acc, device=y.device)
    else:
        inv = _math.cast(scale, acc).reciprocal()
    shift = torch.zeros_like(inv) if bias is None else -_math.cast(bias.detach(), acc) * inv
    torch.addcmul(shift.view(shape), yw, inv.view(shape), out=yw)
    return yw, dz


def recovered_sums(dz: Tensor, xhat: Tensor) -> tuple[Tensor, Tensor]:
    """Local per-channel ``(sum(dz), sum(dz * xhat))`` in one native pass (``xhat`` given, not rebuilt)."""
    channels = xhat.shape[1]
    zero = torch.zeros(channels, dtype=xhat.dtype, device=xhat.device)
    one = torch.ones(channels, dtype=xhat.dtype, device=xhat.device)
    # batch norm backward of "x = xhat, mean 0, var 1, eps 0": invstd is exactly 1.
    _, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
        dz, xhat, None, zero, one, None, None, False, 0.0, [False, True, True]
    )
    return sum_dz, sum_dz_xhat


def input_grad(
    dz: Tensor,
    xhat: Tensor,
    a: Tensor,
    count: float | Tensor | None,
    sums: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """Input gradient from the recovered ``xhat``, ``dz`` and the per-channel scale ``a = s * invstd``.

    Training (``sums`` the global ``[[sum dz], [sum dz*xhat]]``, ``count`` the
    global count): ``a * (dz - sum_dz/N - xhat * sum_dz_xhat/N)``, through
    :func:`syncbn._math.input_grad` with ``x = xhat``, mean 0, variance 1 and
    eps 0. Eval (``sums`` is ``None``): ``a * dz``. Returned in ``dtype``.
    """
    a = _math.cast(a, xhat.dtype)
    if sums is None:
        return torch.mul(dz, a.view(_math.broadcast_shape(dz))).to(dtype)
    assert count is not None
    channels = xhat.shape[1]
    zero = torch.zeros(channels, dtype=xhat.dtype, device=xhat.device)
    one = torch.ones(channels, dtype=xhat.dtype, device=xhat.device)
    sums = _math.cast(sums.to(xhat.device), xhat.dtype)
    grad = _math.input_grad(dz, xhat, a, zero, one, 0.0, count, sums)
    return grad if grad.dtype == dtype else grad.to(dtype)
