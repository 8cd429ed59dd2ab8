"""Functional form of synchronized batch normalization.

:func:`sync_batch_norm` is to :class:`syncbn.SyncBatchNorm` what
``torch.nn.functional.batch_norm`` is to ``nn.BatchNorm2d``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import groups
from ._function import SyncBatchNormFunction, TransformableSyncBatchNormFunction, _Pending

__all__ = ["sync_batch_norm", "check_input"]


def check_input(
    input: Tensor,
    num_features: int | None = None,
    *,
    dims: tuple[int, ...] | None = None,
    dims_text: str = "",
) -> None:
    """Validate a batch-norm input; raise before anything is computed or changed.

    Args:
        input: the tensor to normalise, ``(N, C, *)``.
        num_features: the expected channel count ``C``, or ``None`` to skip that check.
        dims: the accepted numbers of dimensions, or ``None`` for any of at least 2.
        dims_text: how ``dims`` reads in the error message, e.g. ``"2D or 3D"``.

    Raises:
        TypeError: ``input`` is not a floating-point tensor.
        ValueError: ``input`` has fewer than 2 dimensions or the wrong channel count.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a torch.Tensor input (got {type(input).__name__})")
    if not input.is_floating_point():
        raise TypeError(f"expected a floating-point input tensor (got dtype {input.dtype})")
    if dims is not None and input.dim() not in dims:
        raise ValueError(f"expected {dims_text} input (got {input.dim()}D input)")
    if input.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    if num_features is not None and input.shape[1] != num_features:
        raise ValueError(
            f"expected input with {num_features} channels in dimension 1 "
            f"(got {input.shape[1]} channels, input size {list(input.shape)})"
        )


def sync_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    process_group: Any = None,
    *,
    layer: Any = None,
) -> Tensor:
    """Batch normalization whose training statistics span a process group.

    In training, the per-channel mean and variance are those of the
    concatenation of every rank's ``input`` along dimension 0 (uneven and empty
    per-rank batches included):

    .. math::
        y = \\frac{x - \\mathrm{E}[x]}{\\sqrt{\\mathrm{Var}[x] + \\epsilon}} \\cdot w + b

    The running statistics are updated with the global mean and the global
    unbiased variance: ``running = (1 - momentum) * running + momentum * batch``.
    Outside training, or without an initialised process group of more than one
    member, this is exactly ``torch.nn.functional.batch_norm``. Gradients of
    ``weight`` and ``bias`` are this rank's share (sum them over ranks, as DDP
    does, for the global gradient).

    Args:
        input: ``(N, C, *)`` floating-point tensor.
        running_mean: ``(C,)`` buffer updated in place in training, or ``None``.
        running_var: ``(C,)`` buffer updated in place in training, or ``None``.
        weight: ``(C,)`` affine scale or ``None``.
        bias: ``(C,)`` affine shift or ``None``.
        training: use (and synchronise) batch statistics; else use the running ones.
        momentum: running-statistics update factor.
        eps: added to the variance for numerical stability.
        process_group: ``torch.distributed`` group to synchronise over; ``None``
            is the default group, looked up at call time.
        layer: the module this call belongs to (``SyncBatchNorm`` passes itself):
            errors name it, and it carries the once-per-layer handshake state.
            Functional calls without one skip the handshake (debug mode still
            checks them).

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape, dtype and memory format as the input.

    Returns:
        The normalised tensor.

    Raises:
        TypeError: non-floating-point input.
        ValueError: input of fewer than 2 dimensions, a channel count that does
            not match the given statistics or parameters, or (in training) only
            one value per channel over the whole group; the last is raised on
            every rank alike.

    Example::

        >>> x = torch.randn(8, 4, 5, 5)
        >>> y = sync_batch_norm(x, torch.zeros(4), torch.ones(4), training=True)
        >>> y.shape
        torch.Size([8, 4, 5, 5])
    """
    channels = None
    for t in (running_mean, running_var, weight, bias):
        if t is not None:
            channels = t.numel()
            break
    check_input(input, channels)
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    group = groups.resolve(process_group)
    if group is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
    if torch._C._are_functorch_transforms_active():  # torch.func.grad / vjp / vmap
        transformed: Tensor = TransformableSyncBatchNormFunction.apply(
            input, weight, bias, running_mean, running_var, eps, momentum, group, layer, _Pending()
        )
        return transformed
    out: Tensor = SyncBatchNormFunction.apply(
        input, weight, bias, running_mean, running_var, eps, momentum, group, layer
    )
    return out
