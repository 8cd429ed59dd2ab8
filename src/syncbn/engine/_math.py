"""The engine's arithmetic, no communication: local moments, the running update (docs/internals/engine.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..families._arith import (  # noqa: F401 (the shared arithmetic, re-exported for the engine)
    _BLOCK_NUMEL,
    _EMPTY,
    _LOW_PRECISION,
    _is_channels_last,
    _low_precision_input_grad,
    accumulation_dtype,
    backward_sums,
    broadcast_shape,
    cast,
    input_grad,
)
from ..families._protocol import Record as Stats  # noqa: F401 (the record's statistics fields)
from ._packing import _ONES, MomentBuffer, moment_buffer, pack_grad_sums, pack_moments, unpack_moments  # noqa: F401

# Routes of local_moments (docs/internals/engine.md): blocked centring from this many values,
# blocks of this many (2 MiB of float32, stays in cache), the native kernel below the last.
_BLOCKED_MIN_NUMEL = 1 << 20
_NATIVE_STATS_MAX_NUMEL = 1 << 15


def uses_native_statistics(x: Tensor) -> bool:
    """Whether :func:`local_moments` takes the one-call native kernel for ``x`` (then it needs no scratch)."""
    if x.dtype in _LOW_PRECISION:  # on CPU it accumulates in float32, as nn.BatchNorm's
        return x.device.type == "cpu"
    return x.is_cuda or x.dim() == 2 or x.numel() < _NATIVE_STATS_MAX_NUMEL or _is_channels_last(x)


def local_moments(x: Tensor, scratch: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-channel ``(mean, biased var)`` of a non-empty ``(N, C, *)`` batch, in :func:`accumulation_dtype`;
    ``scratch``: a tensor like ``x`` the two-pass routes may centre ``x`` into."""
    dtype = x.dtype
    numel = x.numel()
    if dtype in _LOW_PRECISION:
        if x.is_cpu:
            buffers = moment_buffer(x.shape[1], x.device)
            return torch.batch_norm_update_stats(x, buffers.scratch_mean, buffers.scratch_var, 0.0)
        native = False
    else:  # uses_native_statistics(x), inlined: this runs on every training call
        native = x.is_cuda or x.dim() == 2 or numel < _NATIVE_STATS_MAX_NUMEL or _is_channels_last(x)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if native:
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        return cast(mean, acc), cast(var, acc)
    n = numel // x.shape[1]
    ndim = x.dim()
    dims = _REDUCE_DIMS[ndim] if ndim < len(_REDUCE_DIMS) else [0, *range(2, ndim)]
    mean = x.sum(dims, dtype=acc).div_(n)
    usable = scratch if scratch is not None and scratch.dtype == acc and scratch.is_contiguous() else None
    if numel >= _BLOCKED_MIN_NUMEL and x.shape[0] > 1 and x.is_contiguous():
        return mean, _blocked_m2(x, mean, acc, usable).div_(n)
    # (C, 1, ...) broadcasts against (N, C, ...) as (1, C, 1, ...) does.
    centre = mean.view(_CHANNEL_VIEWS[ndim] if ndim < len(_CHANNEL_VIEWS) else broadcast_shape(x))
    if usable is not None:  # (x - mean)**2 in one pass: the same two roundings as a sub, then a square_
        return mean, _squared_deviations(x, centre, usable).sum(dims).div_(n)
    centred = x - centre  # promoted to ``acc``
    return mean, centred.square_().sum(dims).div_(n)


def _squared_deviations(x: Tensor, centre: Tensor, out: Tensor) -> Tensor:
    """``(x - centre) ** 2`` into ``out``, one kernel (unreduced ``mse_loss``: sub, square_, bit for bit)."""
    if x.dtype == out.dtype:
        return torch._C._nn.mse_loss(x, centre, 0, out=out)  # type: ignore[call-arg,arg-type]
    return torch.sub(x, centre, out=out).square_()


# Per input dimension: the reduced dimensions, and the shape a per-channel vector is viewed in.
_REDUCE_DIMS = [[0, *range(2, d)] for d in range(9)]
_CHANNEL_VIEWS = [(-1,) + (1,) * (d - 2) for d in range(9)]


def _blocked_m2(x: Tensor, mean: Tensor, acc: torch.dtype, scratch: Tensor | None = None) -> Tensor:
    """``sum((x - mean)**2)`` per channel of a contiguous ``x``, a block at a time into ``scratch``."""
    batch, channels = x.shape[0], x.shape[1]
    x3 = x.view(batch, channels, -1)
    rows = max(1, _BLOCK_NUMEL // max(1, x3[0].numel()))
    if scratch is not None:
        buf = scratch.view(batch, channels, -1)[: min(rows, batch)]
    else:
        buf = torch.empty((min(rows, batch),) + tuple(x3.shape[1:]), dtype=acc, device=x.device)
    centre = mean.view(1, channels, 1)
    m2 = torch.zeros_like(mean)
    for start in range(0, batch, rows):
        block = x3[start : start + rows]
        m2 += _squared_deviations(block, centre, buf[: block.shape[0]]).sum((0, 2))
    return m2


def update_running(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    mean: Tensor,
    unbiased_var: Tensor,
    momentum: float,
) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` for the buffers that exist."""
    if (
        running_mean is not None
        and running_var is not None
        and running_mean.dtype == mean.dtype
        and running_var.dtype == unbiased_var.dtype
    ):
        torch._foreach_lerp_([running_mean, running_var], [mean, unbiased_var], momentum)
        return
    for r, s in ((running_mean, mean), (running_var, unbiased_var)):
        if r is not None:
            r.lerp_(s.to(r.dtype), momentum)
