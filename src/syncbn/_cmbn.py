"""CmBN: the statistics hook that pools a block's micro-batches (docs/cmbn.md, docs/architecture.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._accumulating import _is_compiling
from .families._protocol import THIS_CALL, ThisCall

__all__ = ["THIS_CALL", "Carry", "Pool", "statistics", "attach", "detach"]

_ATTR = "_syncbn_cmbn"  # the layer's __dict__ entry while a cumulative block is open

State = tuple[Tensor, Tensor, Tensor, bool]  # (count (1,), mean (C,), m2 (C,), any micro-batch pooled)


def _zeros(channels: int, device: torch.device) -> State:
    zeros = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    return zeros[:1], zeros[1 : channels + 1], zeros[channels + 1 :], False


class Carry:
    """One layer's pooled moments of the block so far (float64, per channel); eager calls replace the
    tensors (replicas share the carry), traced ones update them in place."""

    def __init__(self, channels: int, device: torch.device) -> None:
        self.count, self.mean, self.m2, self.started = _zeros(channels, device)
        self.before: State = _zeros(channels, device)  # (a recomputation pools with the state before)

    def result(self) -> tuple[float, Tensor, Tensor]:
        """``(count, mean, m2)`` of every micro-batch pooled (reads the count on the host)."""
        return float(self.count.item()), self.mean, self.m2


class Pool(NamedTuple):
    """One training call's statistics hook: the carry, the state it pools with, and whether it advances."""

    carry: Carry
    state: State
    recomputing: bool  # a checkpoint's recomputation: pools with the state before, does not advance

    def pool(self, packed: Tensor) -> Tensor:
        """The group-summed ``[n, sum x, sum x^2]`` merged into the carry (Chan et al.), packed alike
        (the block's first micro-batch: ``packed`` itself). Traceable."""
        count, mean, m2, started = self.state
        channels = mean.shape[0]
        n_b, sums = packed[:1], packed[1:].view(2, channels)
        mean_b = sums[0] / n_b.clamp(min=1.0)
        m2_b = (sums[1] - sums[0] * mean_b).clamp(min=0.0)
        total = count + n_b
        share = n_b / total.clamp(min=1.0)
        delta = mean_b - mean
        mean_p = mean + delta * share
        m2_p = m2 + m2_b + delta * delta * (count * share)
        pooled = torch.cat([total, total * mean_p, m2_p + total * mean_p * mean_p])
        carry = self.carry
        if _is_compiling():  # in place (no guard on the carry's values); the first: packed as is
            pooled = torch.where(count > 0, pooled, packed)
            with torch.no_grad():
                for tensor, value in ((carry.count, total), (carry.mean, mean_p), (carry.m2, m2_p)):
                    tensor.copy_(value)
            return pooled
        if not self.recomputing:
            carry.before = self.state
            carry.count, carry.mean, carry.m2, carry.started = total, mean_p, m2_p, True
        return pooled if started else packed


def statistics(layer: Any, recomputing: bool = False) -> Pool | ThisCall:
    """The statistics hook of ``layer``'s training call (outside a cumulative block: ``THIS_CALL``)."""
    carry: Carry | None = layer.__dict__.get(_ATTR)
    if carry is None:
        return THIS_CALL
    if _is_compiling():  # the count tells the first micro-batch (a bool read would be guarded on)
        carry.started = True  # (written, not read: an eager call later in the block pools)
        return Pool(carry, (carry.count, carry.mean, carry.m2, True), False)
    if recomputing:
        return Pool(carry, carry.before, True)
    return Pool(carry, (carry.count, carry.mean, carry.m2, carry.started), False)


def attach(layer: Any, channels: int, device: torch.device) -> Carry:
    """Start pooling ``layer``'s training calls (a new, empty carry)."""
    carry = Carry(channels, device)
    layer.__dict__[_ATTR] = carry
    return carry


def detach(layer: Any) -> None:
    """Stop pooling ``layer``'s training calls (its next call normalises with its own micro-batch)."""
    layer.__dict__.pop(_ATTR, None)
