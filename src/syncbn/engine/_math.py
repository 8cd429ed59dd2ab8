"""The arithmetic of synchronized batch normalization, with no communication.

Works on one process's tensors; :mod:`syncbn.groups` sums the packed tensors made here. The
math is in docs/how-it-works.md, the routes and their reasons in docs/internals/engine.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _packing
from ._packing import _ONES, MomentBuffer, moment_buffer, pack_grad_sums, pack_moments, unpack_moments  # noqa: F401

_LOW_PRECISION = _packing._LOW_PRECISION


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype local statistics are accumulated in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``; ``t`` itself when it already is (a same-dtype ``.to`` still costs a call)."""
    return t if t.dtype == dtype else t.to(dtype)


def broadcast_shape(x: Tensor) -> list[int]:
    """Shape ``[1, C, 1, ...]`` that broadcasts a per-channel vector against ``x``."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}  # per input dimension


def _is_channels_last(x: Tensor) -> bool:
    layout = _CHANNELS_LAST.get(x.dim())
    return layout is not None and x.is_contiguous(memory_format=layout) and not x.is_contiguous()


# Routes of local_moments (docs/internals/engine.md): blocked centring from this many values,
# blocks of this many (2 MiB of float32, stays in cache), the native kernel below the last.
_BLOCKED_MIN_NUMEL = 1 << 20
_BLOCK_NUMEL = 1 << 19
_NATIVE_STATS_MAX_NUMEL = 1 << 15


def uses_native_statistics(x: Tensor) -> bool:
    """Whether :func:`local_moments` takes the one-call native kernel for ``x`` (then it needs no scratch)."""
    if x.dtype in _LOW_PRECISION:  # on CPU it accumulates in float32, as nn.BatchNorm's
        return x.device.type == "cpu"
    return x.is_cuda or x.dim() == 2 or x.numel() < _NATIVE_STATS_MAX_NUMEL or _is_channels_last(x)


def local_moments(x: Tensor, scratch: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-channel ``(mean, biased var)`` of a non-empty ``(N, C, *)`` batch, in :func:`accumulation_dtype`.

    ``scratch``: an optional tensor like ``x`` that may be overwritten (the caller's output buffer),
    into which the two-pass routes centre ``x``. The routes are in docs/internals/engine.md.
    """
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


def normalize(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    var: Tensor,
    eps: float,
    out: Tensor | None = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` in one native pass, into ``out`` (CPU) if given."""
    if out is None:
        return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
    empty = _EMPTY.get(mean.dtype) if mean.is_cpu else None
    if empty is None:
        empty = mean.new_empty(0)  # inference mode leaves the saved statistics empty
    # torch.native_batch_norm(out=...) is the out overload without the Python of torch.ops (~2 us).
    torch.native_batch_norm(x, weight, bias, mean, var, False, 0.0, eps, out=(out, empty, empty))
    return out


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


# Read-only constants, each saving a call per layer.
_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in (*_LOW_PRECISION, torch.float32, torch.float64)}
_ZERO = {dtype: torch.zeros((), dtype=dtype) for dtype in (torch.float32, torch.float64)}


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


def backward_sums(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Local per-channel ``(sum(g), sum(g * xhat))`` in one native pass, in the statistics dtype."""
    if grad_output.dtype in _LOW_PRECISION:
        layout = memory_format(x)
        if layout is not None and not grad_output.is_contiguous(memory_format=layout):
            # The CPU kernel sums 16-bit ``g`` in 16 bits when the formats differ (bfloat16 on torch 2.13).
            grad_output = grad_output.contiguous(memory_format=layout)
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_output, x, weight, mean, var, None, None, False, eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat


def memory_format(x: Tensor) -> torch.memory_format | None:
    """``x``'s dense memory format (contiguous or channels-last), ``None`` for other strides."""
    if _is_channels_last(x):
        return _CHANNELS_LAST[x.dim()]
    return torch.contiguous_format if x.is_contiguous() else None


class Stats(NamedTuple):
    """A training forward's global statistics, as its backward reads them."""

    mean: Tensor  # global mean (statistics dtype)
    var: Tensor  # global biased variance (statistics dtype)
    eps: float  # xhat = (x - mean) / sqrt(var + eps)
    total: float | Tensor  # global count N: a float on the host, a 0-dim float64 tensor on a device
    local_count: int  # this member's values per channel


def input_grad(grad_output: Tensor, x: Tensor, weight: Tensor | None, stats: Stats, sums: Tensor) -> Tensor:
    """Batch norm's input gradient from the global ``sums`` ``[[sum(g)], [sum(g * xhat)]]`` (``(2, C)``).

    One inference-mode batch norm of ``x`` (the correction terms as weight and bias), then
    ``+= g * w * invstd``; 16-bit ``x`` in float32, rounded once. ``stats.total`` must be positive.
    """
    if x.dtype in _LOW_PRECISION:
        return _low_precision_input_grad(grad_output, x, weight, stats, sums)
    mean, var, eps, count = stats.mean, stats.var, stats.eps, stats.total
    zero = _ZERO.get(var.dtype) if x.is_cpu and isinstance(count, float) else None
    mine = zero is not None and var.is_cpu and sums.dtype is var.dtype is mean.dtype  # (see GradBuffer)
    mine = mine and not torch.is_grad_enabled()
    buffer = _packing.grad_buffer(x.shape[1], var.dtype, x.dim()) if mine else None
    scale = (var + eps if buffer is None else torch.add(var, eps, out=buffer.scale)).rsqrt_()  # invstd
    if weight is not None:
        scale.mul_(weight)
    if zero is not None:  # 0 + sums * scale * (-1/N) in one call (``count`` a float here)
        into = None if buffer is None else buffer.corrections
        corrections = cast(torch.addcmul(zero, sums, scale, value=-1.0 / count, out=into), mean.dtype)  # type: ignore[arg-type]
    else:
        corrections = cast(torch.mul(sums, scale * (-1.0 / count)), mean.dtype)
    if buffer is not None:  # its views, made once
        shift, slope, view = buffer.shift, buffer.slope, buffer.scale_view
    else:  # per channel: -w*invstd*sum_dy/N, -w*invstd*sum_dy_xhat/N
        (shift, slope), view = corrections.unbind(0), scale.view(broadcast_shape(x))
    grad_input = torch.batch_norm(x, slope, shift, mean, var, False, 0.0, eps, False)
    return grad_input.addcmul_(grad_output, view)


def _low_precision_input_grad(
    grad_output: Tensor,
    x: Tensor,
    weight: Tensor | None,
    stats: Stats,
    sums: Tensor,
    blocked: bool | None = None,
) -> Tensor:
    """:func:`input_grad` for 16-bit ``x``: every step in float32, rounded once (the two terms nearly cancel).

    ``blocked`` (default: on CPU) runs cache-sized blocks through two float32 buffers, else three
    kernels over the whole batch; see docs/internals/engine.md.
    """
    eps = stats.eps
    acc = torch.promote_types(stats.mean.dtype, torch.float32)
    mean, var = cast(stats.mean, acc), cast(stats.var, acc)
    invstd = (var + eps).rsqrt_()
    scale = invstd if weight is None else invstd * cast(weight, acc)
    shift, slope = torch.mul(cast(sums, acc), scale * (-1.0 / stats.total)).unbind(0)
    shape = broadcast_shape(x)
    grad_input = torch.empty_like(x)
    if blocked is None:
        blocked = x.device.type == "cpu"
    if not blocked:
        buf = torch.sub(x, mean.view(shape))  # promoted to float32
        torch.addcmul(shift.view(shape), buf, (slope * invstd).view(shape), out=buf)
        return torch.addcmul(buf, grad_output, scale.view(shape), out=grad_input)

    batch = x.shape[0]
    rows = max(1, min(batch, _BLOCK_NUMEL // max(1, x[0].numel())))
    widened = torch.empty_like(x[:rows], dtype=acc)
    result = torch.empty_like(widened)
    scale = scale.view(shape)
    for start in range(0, batch, rows):
        stop = min(start + rows, batch)
        buf, res = widened[: stop - start], result[: stop - start]
        buf.copy_(x[start:stop])
        normalize(buf, slope, shift, mean, var, eps, out=res)
        buf.copy_(grad_output[start:stop])
        res.addcmul_(buf, scale)
        grad_input[start:stop].copy_(res)
    return grad_input


def local_grad_sums(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, stats: Stats
) -> tuple[Tensor, Tensor]:
    """This member's ``(sum(dy), sum(dy * xhat))``; zeros for an empty local batch."""
    if stats.local_count > 0:
        return backward_sums(grad_output, x, weight, stats.mean, stats.var, stats.eps)
    zeros = torch.zeros(x.shape[1], dtype=stats.mean.dtype, device=x.device)
    return zeros, zeros.clone()


def finish_input_grad(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, stats: Stats, reduced: Tensor
) -> Tensor:
    """Input gradient from the group-summed ``reduced`` (``(2, C)``); zeros for an empty local batch."""
    if stats.local_count == 0:
        return torch.zeros_like(x)
    if reduced.device != x.device:  # nn.DataParallel: summed on the first replica's device
        reduced = reduced.to(x.device)
    return input_grad(grad_output, x, weight, stats, reduced)
