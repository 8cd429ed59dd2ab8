"""Functional form of synchronized batch normalization: :func:`sync_batch_norm` is to
:class:`syncbn.SyncBatchNorm` what ``torch.nn.functional.batch_norm`` is to ``nn.BatchNorm2d``."""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import groups
from ._errors import ChannelCountError
from .engine._function import Params, apply
from .families._protocol import THIS_CALL
from .families.inplace_abn import InPlaceABN, check_call

__all__ = ["sync_batch_norm", "check_input", "check_mask", "apply_masked"]


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
        ValueError: ``input`` has fewer than 2 dimensions or the wrong channel count (the
            latter also a ``RuntimeError``, as ``F.batch_norm`` raises).
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
        raise ChannelCountError(
            f"expected input with {num_features} channels in dimension 1 "
            f"(got {input.shape[1]} channels, input size {list(input.shape)})"
        )


def check_mask(input: Tensor, mask: Any) -> None:
    """Validate a mask of valid positions for ``input``; raise before anything is computed.

    Args:
        input: the ``(N, C, *)`` tensor to normalise.
        mask: a boolean tensor of shape ``(N, *)`` (``input``'s shape without dimension 1) on its device.

    Raises:
        TypeError: ``mask`` is not a boolean tensor.
        ValueError: ``mask`` has the wrong shape or device.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"expected mask to be a torch.Tensor or None (got {type(mask).__name__})")
    if mask.dtype != torch.bool:
        raise TypeError(f"expected a boolean mask of valid positions (got dtype {mask.dtype})")
    expected = [input.shape[0], *input.shape[2:]]
    if list(mask.shape) != expected:
        raise ValueError(
            f"expected a mask of shape {expected} (input size {list(input.shape)} without the channel "
            f"dimension), got mask size {list(mask.shape)}"
        )
    if mask.device != input.device:
        raise ValueError(f"expected the mask on the input's device {input.device} (got {mask.device})")


def apply_masked(norm: Callable[[Tensor], Tensor], input: Tensor, mask: Tensor) -> Tensor:
    """Apply a batch norm ``norm`` to the valid positions of ``input`` only.

    The valid positions (``mask`` true) are gathered into a batch of shape ``(M, C, 1, ..., 1)`` (``input``'s
    number of dimensions, so input checks still pass), ``norm`` normalises (and, if it does, synchronises) it,
    and the output is scattered back: 0 at padded positions, which get no gradient.

    Args:
        norm: a function from a batch of positions to its normalisation, e.g. a
            ``SyncBatchNorm`` layer's forward.
        input: :math:`(N, C, *)` tensor.
        mask: boolean :math:`(N, *)` tensor, ``True`` at valid positions.

    Shape:
        - Input: :math:`(N, C, *)`; mask :math:`(N, *)`.
        - Output: same shape, dtype and memory format as ``input``.

    Returns:
        The normalised tensor, 0 at padded positions.

    Example::

        >>> x, mask = torch.randn(4, 8, 10), torch.rand(4, 10) > 0.3
        >>> y = apply_masked(syncbn.SyncBatchNorm1d(8), x, mask)
    """
    check_input(input)
    check_mask(input, mask)
    channels = input.shape[1]
    flat = input.movedim(1, -1)[mask]  # (M, C): the valid positions, in order
    y = norm(flat.reshape(flat.shape[0], channels, *([1] * (input.dim() - 2))))
    out = torch.zeros_like(input)
    out.movedim(1, -1)[mask] = y.reshape(flat.shape[0], channels)
    return out


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
    mask: Tensor | None = None,
) -> Tensor:
    """Batch normalization whose training statistics span a process group.

    In training, the per-channel mean and variance are those of the concatenation of every rank's ``input``
    along dimension 0 (uneven and empty per-rank batches included):

    .. math::
        y = \\frac{x - \\mathrm{E}[x]}{\\sqrt{\\mathrm{Var}[x] + \\epsilon}} \\cdot w + b

    The running statistics are updated with the global mean and unbiased variance:
    ``running = (1 - momentum) * running + momentum * batch``. Outside training, or without a process group of
    more than one member, this is exactly ``torch.nn.functional.batch_norm``. Gradients of ``weight`` and
    ``bias`` are this rank's share (DDP sums them over ranks).

    Args:
        input: ``(N, C, *)`` floating-point tensor.
        running_mean: ``(C,)`` buffer updated in place in training, or ``None``.
        running_var: ``(C,)`` buffer updated in place in training, or ``None``.
        weight: ``(C,)`` affine scale or ``None``.
        bias: ``(C,)`` affine shift or ``None``.
        training: use (and synchronise) batch statistics; else use the running ones.
        momentum: running-statistics update factor, any real number (numpy scalars and
            ``Fraction`` too, taken as their ``float``).
        eps: added to the variance for numerical stability.
        process_group: ``torch.distributed`` group to synchronise over; ``None``
            is the default group, looked up at call time.
        layer: the module this call belongs to (``SyncBatchNorm`` passes itself):
            errors name it, and it carries the once-per-layer handshake state.
            Calls without one skip the handshake (debug mode still checks them).
        mask: optional boolean tensor of valid positions, shape ``(N, *)`` (``input``'s shape without
            dimension 1; ``(N, L)`` for padded sequences ``(N, C, L)``). Statistics (and the running update)
            are ``nn.BatchNorm``'s over the valid positions of all ranks' batches. Padded positions
            output 0 with zero gradient (training and eval); a rank without one joins with an empty batch.

    Shape:
        - Input: :math:`(N, C, *)`
        - Mask (optional): :math:`(N, *)`, boolean
        - Output: same shape, dtype and memory format as the input.

    Returns:
        The normalised tensor.

    Raises:
        TypeError: non-floating-point input, a mask that is not boolean, or (in
            training, with running statistics) a ``momentum`` that is not a number.
        ValueError: input of fewer than 2 dimensions, a channel count that does not match the given statistics
            or parameters, a mask of the wrong shape or device, only one of ``running_mean`` and
            ``running_var`` given or an ``eps`` that is not positive in training (as ``F.batch_norm``), or (in
            training, on every rank alike) only one value per channel over the whole group. A channel count
            that does not match is also a ``RuntimeError``, the type ``F.batch_norm`` raises for it.

    Example::

        >>> x = torch.randn(8, 4, 5, 5)
        >>> y = sync_batch_norm(x, torch.zeros(4), torch.ones(4), training=True)
        >>> y.shape
        torch.Size([8, 4, 5, 5])
        >>> # padded sequences (N, C, L): statistics over the valid positions only
        >>> seq, lengths = torch.randn(3, 4, 7), torch.tensor([7, 5, 2])
        >>> mask = torch.arange(7) < lengths[:, None]          # (N, L), True = valid
        >>> y = sync_batch_norm(seq, None, None, training=True, mask=mask)
    """
    per_channel = {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias}
    channels = next((t.numel() for t in per_channel.values() if t is not None), None)
    check_input(input, channels)
    check_per_channel(channels, per_channel)
    if training:
        if (running_mean is None) != (running_var is None):
            raise ValueError("running_mean and running_var must either both be None or neither be None")
        if running_mean is not None:
            if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
                raise TypeError(
                    "sync_batch_norm(): expected momentum to be a float when running statistics are "
                    f"given (got {type(momentum).__name__})"
                )
            # As the layers take it: a Fraction reached the engine's update (TypeError, after the collective).
            momentum = float(momentum)
        check_eps(eps)
    if mask is not None:
        args = (running_mean, running_var, weight, bias, training, momentum, eps, process_group)
        return apply_masked(lambda flat: sync_batch_norm(flat, *args, layer=layer), input, mask)
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    group = groups.resolve(process_group)
    if group is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
    return apply(input, weight, bias, Params(running_mean, running_var, eps, momentum, group, layer))


def check_per_channel(channels: int | None, tensors: dict[str, Tensor | None]) -> None:
    """Raise :class:`ChannelCountError` for a tensor (name -> tensor or ``None``) without one element
    per channel, before any is read or written."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.numel() != channels:
            raise ChannelCountError(
                f"expected {name} with {channels} elements, one per channel of the input "
                f"(got {tensor.numel()} elements)"
            )


def check_eps(eps: float) -> None:
    """Raise torch's ``ValueError`` for an ``eps`` that is not positive (training divides by it)."""
    if not eps > 0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")


def inplace_abn_apply(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    param: float,
    group: Any,
    layer: Any = None,
    statistics: Any = THIS_CALL,
) -> Tensor:
    """In-place activated batch norm on the engine, over ``group`` in training; returns ``x``, overwritten."""
    check_call(x, weight, running_mean, running_var, training)
    family = InPlaceABN(activation, param, training)
    group = group if training else None
    params = Params(running_mean, running_var, eps, momentum, group, layer, family, statistics)
    return apply(x, weight, bias, params)
