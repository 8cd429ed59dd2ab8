"""The reference for the in-place activated layers: float64 nn.BatchNorm (weight |w| + eps) + activation.

Used by the single-process, DataParallel and multi-rank tests: the layer's output, input
gradient, weight/bias gradients and running statistics on the global batch.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

ACTS = {
    "leaky_relu": lambda t, p: F.leaky_relu(t, p),
    "elu": lambda t, p: F.elu(t, p),
    "identity": lambda t, p: t,
    "relu": lambda t, p: F.relu(t),
}


def reference(
    x: Tensor,
    grad: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running: tuple[Tensor, Tensor] | None,
    *,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    param: float = 0.01,
    abs_weight: bool = True,
) -> dict[str, Any]:
    """Output, gradients and updated running statistics of BN + activation, all in float64."""
    x = x.detach().double().requires_grad_()
    w = None if weight is None else weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    rm = rv = None
    if running is not None:
        rm, rv = running[0].detach().double().clone(), running[1].detach().double().clone()
    scale = None if w is None else (w.abs() + eps if abs_weight else w)
    y = ACTS[activation](F.batch_norm(x, rm, rv, scale, b, training or rm is None, momentum, eps), param)
    y.backward(grad.double())
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": None if w is None else w.grad,
        "db": None if b is None else b.grad,
        "rm": rm,
        "rv": rv,
    }


def max_error(a: Tensor | None, b: Tensor | None) -> float:
    """Max absolute difference relative to max(1, |b|_inf); 0 for two ``None`` or empty tensors."""
    if a is None or b is None:
        assert a is None and b is None, "one of the two is None"
        return 0.0
    if b.numel() == 0:
        return 0.0
    scale = max(1.0, b.detach().double().abs().max().item())
    return (a.detach().double() - b.detach().double()).abs().max().item() / scale
