"""The packed moments one collective sums, their unpacking, the buffers (docs/internals/engine.md)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..families._arith import _LOW_PRECISION, _constant, _per_thread

# Read-only one-element tensors for the head of the packed vector (each saves a call per layer).
_ONES = {dtype: torch.ones(1, dtype=dtype) for dtype in (torch.float32, torch.float64)}


class MomentBuffer:
    """One thread's reusable forward buffers for a channel count on a device, views made once (``words``:
    a float64 memoryview of ``packed`` on the host; ``scratch_*``: the 16-bit native kernel's)."""

    def __init__(self, channels: int, device: torch.device) -> None:
        size = 2 * channels + 1
        with torch.inference_mode(False):  # usable in place inside and outside inference mode
            if device.type == "cpu":
                self._memory: bytearray | None = bytearray(8 * size)
                self.packed = torch.frombuffer(self._memory, dtype=torch.float64)
                self.words: Any = memoryview(self._memory).cast("d")  # float64 items
            else:
                self._memory = self.words = None
                self.packed = torch.empty(size, dtype=torch.float64, device=device)
            self.stats = torch.empty(2, channels, dtype=torch.float64, device=device)
            self.scratch_mean = torch.zeros(channels, dtype=torch.float32, device=device)
            self.scratch_var = torch.ones(channels, dtype=torch.float32, device=device)
            self.widened = torch.empty(channels, dtype=torch.float64, device=device)  # the mean, float64
        self.head = self.packed[0]
        self.sums = self.packed[1:].view(2, channels)
        self.means, self.squares = self.sums.unbind(0)
        self.stat_means, self.stat_vars = self.stats.unbind(0)


def moment_buffer(channels: int, device: torch.device) -> MomentBuffer:
    """This thread's :class:`MomentBuffer` (per thread: DataParallel's replicas never share one)."""
    return _per_thread("moments", MomentBuffer, channels, device)


def pack_moments(
    count: int,
    mean: Tensor | None,
    var: Tensor | None,
    *,
    channels: int,
    device: torch.device,
    buffer: MomentBuffer | None = None,
) -> Tensor:
    """Local moments as the float64 ``[n, n*mean, n*(var + mean^2)]`` (zeros without ``mean``). Written into
    ``buffer.packed`` when given, else a new tensor on ``device``."""
    if count == 0:
        if buffer is not None:
            return buffer.packed.zero_()
        return torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    assert mean is not None and var is not None
    if buffer is None:
        one = _ONES.get(mean.dtype) if mean.device.type == "cpu" else None
        packed = torch.empty(2 * channels + 1, dtype=torch.float64, device=device)
        torch.cat([mean.new_ones(1) if one is None else one, mean, var], out=packed)  # widened to float64
        packed.mul_(count)  # [n, n*mean, n*var]
        packed[channels + 1 :].addcmul_(packed[1 : channels + 1], mean)
        return packed
    # Widening copies into the buffer's rows, one call: a cat that widens costs 3-4 as much on CPU.
    means, squares, widened = buffer.means, buffer.squares, buffer.widened
    torch._foreach_copy_([means, squares, widened], [mean, var, mean])  # widened exactly to float64
    buffer.sums.mul_(float(count))  # [n*mean, n*var] (a float: an int scalar is cast, a call more)
    words = buffer.words
    if words is not None:
        words[0] = float(count)
    else:
        buffer.head.fill_(count)
    # n*var + (n*mean)*mean, the float32 mean widened exactly: S and Q describe the same mean.
    squares.addcmul_(means, widened)
    return buffer.packed


def unpack_moments(
    packed: Tensor,
    channels: int,
    *,
    read_count: bool | None = None,
    dtype: torch.dtype = torch.float64,
    buffer: MomentBuffer | None = None,
) -> tuple[float | Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``(count, (mean, var, unbiased))`` from the summed packed vector, statistics in ``dtype``; ``count``
    a float when read on the host (``read_count``, default: a CPU ``packed``), else a 0-dim tensor."""
    mine = buffer if buffer is not None and packed is buffer.packed else None
    sums = mine.sums if mine is not None else packed[1:].view(2, channels)  # [S, Q]
    count: float | Tensor
    if packed.is_cpu if read_count is None else read_count:
        words = mine.words if mine is not None else None
        count = words[0] if words is not None else float(mine.head if mine is not None else packed[0])
        unbias: float | Tensor = count / max(count - 1.0, 1.0)
        if mine is not None and dtype != torch.float64:
            torch.mul(sums, 1.0 / max(count, 1.0), out=mine.stats)  # [mean, Q/N]
            mean, var = mine.stat_means, mine.stat_vars
            var.addcmul_(mean, mean, value=-1.0).clamp_(min=0.0)
            mean, var = mine.stats.to(dtype).unbind(0)
            return count, (mean, var, var * _constant(unbias, dtype))  # type: ignore[arg-type]
        stats = torch.mul(sums, 1.0 / max(count, 1.0))  # [mean, Q/N], a new tensor
    else:
        count = mine.head.clone() if mine is not None else packed[0]
        stats = sums / count.clamp(min=1.0)
        unbias = count / (count - 1.0).clamp(min=1.0)
    mean, var = stats.unbind(0)
    # Q/N - mean^2 in float64: the cancellation costs ~1e-16 (mean^2 + var) / var, relative.
    var.addcmul_(mean, mean, value=-1.0).clamp_(min=0.0)
    if dtype != torch.float64:
        mean, var = stats.to(dtype).unbind(0)
    return count, (mean, var, var * unbias)


def pack_grad_sums(sum_dy: Tensor, sum_dy_xhat: Tensor) -> Tensor:
    """The backward's all_reduce buffer ``[[sum_dy], [sum_dy_xhat]]``, ``(2, C)``, at least float32."""
    packed = torch.stack([sum_dy, sum_dy_xhat])
    return packed.float() if packed.dtype in _LOW_PRECISION else packed
