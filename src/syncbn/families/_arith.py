"""The shared arithmetic of every family and the engine, torch only (docs/internals/engine.md)."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_BLOCK_NUMEL = 1 << 19  # a block of this many values (2 MiB of float32) stays in cache


_thread_state = threading.local()
_Buffer = TypeVar("_Buffer")


def _per_thread(slot: str, make: Callable[..., _Buffer], *key: Any) -> _Buffer:
    """This thread's ``make(*key)`` in its cache ``slot`` (made on first use; at most 256 kept)."""
    cache: dict[tuple[Any, ...], _Buffer] | None = getattr(_thread_state, slot, None)
    if cache is None:
        cache = {}
        setattr(_thread_state, slot, cache)
    buffer = cache.get(key)
    if buffer is None:
        if len(cache) >= 256:
            cache.clear()
        buffer = cache[key] = make(*key)
    return buffer


class GradBuffer:
    """One thread's reusable per-channel buffers of the host input gradient (one dtype and rank)."""

    def __init__(self, channels: int, dtype: torch.dtype, ndim: int) -> None:
        with torch.inference_mode(False):  # usable in place inside and outside inference mode
            self.scale = torch.empty(channels, dtype=dtype)
            self.corrections = torch.empty(2, channels, dtype=dtype)
            self.scale_view = self.scale.view([1, channels] + [1] * (ndim - 2))
            self.shift, self.slope = self.corrections.unbind(0)


def grad_buffer(channels: int, dtype: torch.dtype, ndim: int) -> GradBuffer:
    """This thread's :class:`GradBuffer` for ``channels`` values of ``dtype`` against ``ndim``-D input."""
    return _per_thread("grads", GradBuffer, channels, dtype, ndim)


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


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, unconverted where it has it (traced, a ``to`` is an operation dynamo records)."""
    return t if t.dtype == dtype else t.to(dtype)


@functools.lru_cache(maxsize=256)
def _constant(value: float, dtype: torch.dtype) -> Tensor:
    """A read-only 0-dim ``value`` in ``dtype`` (a Python float is cast to a tensor on every call)."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=dtype)


# Read-only constants, each saving a call per layer.
_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in (*_LOW_PRECISION, torch.float32, torch.float64)}
_ZERO = {dtype: torch.zeros((), dtype=dtype) for dtype in (torch.float32, torch.float64)}


def backward_sums(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Local per-channel ``(sum(g), sum(g * xhat))`` in one native pass, in the statistics dtype."""
    if grad_output.dtype in _LOW_PRECISION:
        layout = memory_format(x)
        if layout is not None and not grad_output.is_contiguous(memory_format=layout):
            # The CPU kernel sums 16-bit ``g`` in 16 bits when the formats differ (bfloat16 on torch 2.13).
            grad_output = grad_output.contiguous(memory_format=layout)
    _, sum_dy_xhat, sum_dy = _native_batch_norm_backward(
        grad_output, x, weight, mean, var, None, None, False, eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat


_native_backward = torch.ops.aten.native_batch_norm_backward  # its C entry (Python __call__s skipped, ~2 us):
_native_batch_norm_backward: Any = getattr(_native_backward.default, "_op", _native_backward)


def memory_format(x: Tensor) -> torch.memory_format | None:
    """``x``'s dense memory format (contiguous or channels-last), ``None`` for other strides."""
    if _is_channels_last(x):
        return _CHANNELS_LAST[x.dim()]
    return torch.contiguous_format if x.is_contiguous() else None


def input_grad(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, stats: Any, sums: Tensor, out: Tensor | None = None
) -> Tensor:
    """Batch norm's input gradient from the global ``sums`` ``[[sum(g)], [sum(g * xhat)]]`` (``(2, C)``).

    One inference-mode batch norm of ``x`` (the correction terms as weight and bias), then
    ``+= g * w * invstd``. ``out`` (CPU, dense, not 16-bit; maybe ``x``): written there.
    """
    if x.dtype in _LOW_PRECISION:
        return _low_precision_input_grad(grad_output, x, weight, stats, sums)
    mean, var, eps, count = stats.mean, stats.var, stats.eps, stats.total
    zero = _ZERO.get(var.dtype) if x.is_cpu and isinstance(count, float) else None
    mine = zero is not None and var.is_cpu and sums.dtype is var.dtype is mean.dtype  # (see GradBuffer)
    mine = mine and not torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
    buffer = grad_buffer(x.shape[1], var.dtype, x.dim()) if mine else None
    scale = (
        var + eps if buffer is None else torch.add(var, _constant(eps, var.dtype), out=buffer.scale)
    ).rsqrt_()
    if weight is not None:
        scale.mul_(weight)
    if zero is not None:  # 0 + sums * scale * (-1/N) in one call (``count`` a float here)
        into = None if buffer is None else buffer.corrections
        corrections = cast(torch.addcmul(zero, sums, scale, value=-1.0 / count, out=into), mean.dtype)  # type: ignore[arg-type]
    else:
        corrections = cast(torch.mul(sums, scale * (-1.0 / count)), mean.dtype)
    if buffer is not None:  # its views, made once; one native_batch_norm call, not torch.batch_norm's three
        shift, slope, view = buffer.shift, buffer.slope, buffer.scale_view
        out = torch.empty_like(x) if out is None and x.is_contiguous() else out
    else:  # per channel: -w*invstd*sum_dy/N, -w*invstd*sum_dy_xhat/N
        (shift, slope), view = corrections.unbind(0), scale.view(broadcast_shape(x))
    if out is None:
        grad_input = torch.batch_norm(x, slope, shift, mean, var, False, 0.0, eps, False)
    else:  # (the CPU kernel reads each value before writing it)
        grad_input = normalize(x, slope, shift, mean, var, eps, out=out)
    return grad_input.addcmul_(grad_output, view)


def _low_precision_input_grad(
    grad_output: Tensor,
    x: Tensor,
    weight: Tensor | None,
    stats: Any,
    sums: Tensor,
) -> Tensor:
    """:func:`input_grad` for 16-bit ``x``: every step in float32, rounded once (the two terms nearly cancel);
    on CPU in cache-sized blocks through two float32 buffers."""
    eps = stats.eps
    acc = torch.promote_types(stats.mean.dtype, torch.float32)
    mean, var = cast(stats.mean, acc), cast(stats.var, acc)
    invstd = (var + eps).rsqrt_()
    scale = invstd if weight is None else invstd * cast(weight, acc)
    shift, slope = torch.mul(cast(sums, acc), scale * (-1.0 / stats.total)).unbind(0)
    shape = broadcast_shape(x)
    grad_input = torch.empty_like(x)
    if x.device.type != "cpu":
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
