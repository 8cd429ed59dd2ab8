"""In-place activated batch norm (InPlace-ABN, Rota Bulò et al., CVPR 2018) as a family: its math only.

The math: docs/memory.md; how the gradients are evaluated: docs/internals/engine.md.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._errors import ChannelCountError
from . import _arith
from ._protocol import Record
from .batchnorm import BATCH_NORM

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
    """Raise ``ValueError`` for an activation the (in-place) layer cannot use (``relu`` only when not
    ``in_place``; in place, a positive finite ``param``). Checked at every forward too."""
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


def recover(
    y: Tensor, grad: Tensor, activation: str, param: float, traced: bool = False
) -> tuple[Tensor, Tensor, bool]:
    """``(z, dz, scratch)``: the activation's input and its gradient recovered from ``y``, in the
    accumulation dtype (``scratch``: ``z`` is new); ``traced`` (and torch.func): out of place only."""
    acc = _arith.accumulation_dtype(y.dtype)
    p = float(param)
    widen = y.dtype != acc
    yw = y.to(acc) if widen else y
    gw = _arith.cast(grad, acc)
    reuse = not traced and not torch._C._are_functorch_transforms_active()  # (vmap: no where(out=) rule)
    if activation == "leaky_relu":
        dz = torch.ops.aten.leaky_relu_backward(gw, yw, p, True)
        # The inverse of leaky_relu(., p), in place where ``yw`` is a widened copy.
        return F.leaky_relu(yw, 1.0 / p, inplace=widen and reuse), dz, True
    if activation == "elu":
        dz = torch.ops.aten.elu_backward(gw, p, 1.0, 1.0, True, yw)
        # log1p(y / alpha) where y < 0, kept finite where saturated (y == -alpha).
        low = -1.0 + torch.finfo(acc).eps
        if not reuse:
            return torch.where(yw < 0, torch.div(yw, p).clamp(min=low).log1p(), yw), dz, True
        inner = torch.div(yw, p).clamp_(min=low).log1p_()
        return torch.where(yw < 0, inner, yw, out=inner), dz, True
    return yw, gw, widen


def as_batch_norm(
    weight: Tensor | None, bias: Tensor | None, invstd: Tensor, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean, s, weight)`` in ``dtype``: batch norm's backward over ``(z, dz)`` with mean ``b``, invstd
    ``1/s`` and this weight, ``s^2 * invstd``, is the in-place layer's (``xhat = (z - b) / s``)."""
    invstd = _arith.cast(invstd, dtype)
    s = torch.ones_like(invstd) if weight is None else _arith.cast(weight.detach().abs() + eps, dtype)
    mean = torch.zeros_like(invstd) if bias is None else _arith.cast(bias.detach(), dtype)
    return mean, s, s * s * invstd


class InPlaceABN(NamedTuple):
    """One call of the in-place family: its activation and parameter, train or eval; scale ``|w| + eps``.

    Its backward is batch norm's kernels over the recovered ``(z, dz)``, mapped by :func:`as_batch_norm`.
    """

    activation: str
    param: float
    training: bool = True

    # The protocol's questions: written over the input, it saves its output and recovers the input.
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
        """``x <- act(x * a + c)``, ``a = s * invstd`` and ``c = b - mean * a``, with ``m``'s mean and
        biased variance: the global batch's in training, the running ones in eval."""
        eps, mean = m.eps, m.mean
        invstd = (m.var + eps).rsqrt()
        if m.local_count > 0:
            a = invstd if weight is None else invstd * _arith.cast(weight.detach().abs() + eps, invstd.dtype)
            c = -mean * a if bias is None else _arith.cast(bias.detach(), a.dtype) - mean * a
            activate_(x, a, c, self.activation, self.param)
        return m._replace(out=x, weight=weight, invstd=invstd, training=self.training)

    def native_forward(
        self, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Any, stat: torch.dtype
    ) -> Record:
        """Without a group: ``nn.BatchNorm``'s own training kernel over ``x``, then the activation."""
        eps = params.eps
        scale = None if weight is None else weight.detach().abs() + eps
        b = None if bias is None else bias.detach()
        running = (params.running_mean, params.running_var, True, params.momentum, eps)
        # On a contiguous or channels-last x the CPU kernel reads each value before writing over it.
        if x.device.type == "cpu" and _arith.memory_format(x) is not None:
            invstd = torch.empty(x.shape[1], dtype=stat)
            save = {"save_mean": torch.empty_like(invstd), "save_invstd": invstd}
            torch.ops.aten.native_batch_norm.out(x, scale, b, *running, out=x, **save)
        else:  # (any other layout, e.g. t[:, ::2]: it would read values it already wrote)
            out, _, invstd = torch.native_batch_norm(x, scale, b, *running)
            x.copy_(out)
        activate_(x, None, None, self.activation, self.param)
        count = x.numel() // x.shape[1]
        return Record(None, None, eps, float(count), count, out=x, weight=weight, invstd=invstd, native=True)

    def grad_sums(
        self, y: Tensor, grad: Tensor, weight: Any, bias: Any, stats: Record, need_input: bool
    ) -> tuple[Any, Tensor, Tensor]:
        """``(carry, sum(dz), sum(dz * xhat))``: batch norm's over the mapped, recovered ``(z, dz)``;
        after the one-kernel forward, ONE native backward, whose ``carry`` is the input gradient."""
        z, dz, scratch = recover(y, grad, self.activation, self.param)
        mean, s, w = as_batch_norm(weight, bias, stats.invstd, stats.eps, z.dtype)
        if stats.native:
            grad_input, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
                dz, z, w, None, None, mean, s.reciprocal(), True, stats.eps, [need_input, True, True]
            )
            return grad_input, sum_dz, sum_dz_xhat
        mapped = stats._replace(mean=mean, var=s * s, eps=0.0, weight=w)
        if stats.local_count and torch._C._are_functorch_transforms_active():  # (vmap: no eval-form rule)
            dims, shape = [0, *range(2, z.dim())], _arith.broadcast_shape(z)
            return (z, dz, scratch, s, mapped), dz.sum(dims), (dz * (z - mean.view(shape))).sum(dims) / s
        return (z, dz, scratch, s, mapped), *BATCH_NORM.grad_sums(z, dz, None, None, mapped, need_input)[1:]

    def input_grad(
        self, y: Tensor, grad: Tensor, weight: Any, bias: Any, stats: Record, carry: Any, reduced: Any
    ) -> Tensor:
        """The input gradient in ``y``'s dtype: batch norm's over the mapped ``(z, dz)`` (written over ``z``
        where it is scratch); eval (no ``reduced``): ``dz * s * invstd``."""
        if stats.native:  # computed with the sums
            return _arith.cast(carry, y.dtype)
        z, dz, scratch, s, mapped = carry
        if stats.local_count == 0:
            return torch.zeros_like(y)
        if reduced is None:  # constant statistics
            grad_input = torch.mul(
                dz, (s * _arith.cast(stats.invstd, z.dtype)).view(_arith.broadcast_shape(z))
            )
        else:
            out = z if scratch and z.is_cpu and _arith.memory_format(z) is not None else None
            reduced = _arith.cast(reduced.to(z.device), z.dtype)
            grad_input = _arith.input_grad(dz, z, mapped.weight, mapped, reduced, out)
        return _arith.cast(grad_input, y.dtype)

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

    # The traced kernel set (syncbn.engine._compiled): the same map and inverse, out of place.

    def traced_forward(
        self, x: Tensor, weight: Any, bias: Any, mean: Tensor, var: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Any, Any, Any]:
        """:meth:`forward` over ``x`` (the traced Function's copy, or ``x`` itself without grad)."""
        with torch.no_grad():
            self.forward(x, weight, bias, Record(mean, var, eps, None, x.numel()), None)
        return x, weight, bias, None

    def traced_grad_terms(
        self, y: Tensor, grad: Tensor, weight: Any, bias: Any, mean: Tensor, invstd: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Batch norm's ``(dy, xhat, w * invstd)`` over the ``(z, dz)`` recovered from ``y``, mapped."""
        z, dz, _ = recover(y, grad, self.activation, self.param, traced=True)
        b, s, w = as_batch_norm(weight, bias, invstd, eps, z.dtype)
        return BATCH_NORM.traced_grad_terms(z, dz, w, None, b, s.reciprocal(), eps)

    def vmap_error(self, batched_input: bool, batched_parameters: bool) -> str:
        got = "batch statistics (training, or eval without running statistics)"
        if not self.training:
            got = "a batched weight or bias" if batched_input else "an unbatched input"
        return VMAP.format(got=got)
