"""The running-statistics hook that :class:`syncbn.accumulation` listens on (docs/internals/tools.md)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Moments", "observe", "listening"]

# As syncbn.engine._rules.is_compiling (above this layer-0 module); torch 2.2 has no torch.compiler's.
_is_compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling

# id(running_mean) -> the merged moments of the block that listens on it.
_listeners: dict[int, Moments] = {}


class Moments:
    """The count, mean and sum of squared deviations per channel of the batches seen, in float64.

    ``running_mean`` is kept alive while listening, so its ``id`` cannot be reused.
    """

    def __init__(self, running_mean: Tensor) -> None:
        self.running_mean = running_mean
        device = running_mean.device
        # One element, not 0-dim: AOTAutograd (torch 2.13) dropped in-place updates of 0-dim ones.
        self.count = torch.zeros(1, dtype=torch.float64, device=device)
        self.mean = torch.zeros(running_mean.shape, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(running_mean.shape, dtype=torch.float64, device=device)
        self.batches: list[tuple[float | Tensor, Tensor]] = []  # eager: (count, stack(mean, var))
        self.local = False  # a batch came from nn.DataParallel replicas (not the layer's group)

    def add(self, count: float | Tensor, mean: Tensor, var: Tensor, unbiased: bool = False) -> None:
        """Add one batch: ``count`` values per channel, ``mean`` and biased (or ``unbiased``) ``var``."""
        if unbiased or _is_compiling():
            self._merge(count, mean, var, unbiased)
            return
        kept = count.detach().clone() if isinstance(count, Tensor) else float(count)
        self.batches.append((kept, torch.stack((mean.detach(), var.detach()))))

    def _merge(self, count: float | Tensor, mean: Tensor, var: Tensor, unbiased: bool) -> None:
        # Chan et al.: d = mean_b - mean_a, n = n_a + n_b: mean = mean_a + d * n_b / n,
        # m2 = m2_a + m2_b + d^2 * n_a * n_b / n. An empty batch changes nothing.
        n_b = torch.as_tensor(count, dtype=torch.float64, device=self.count.device)
        mean_b = mean.detach().to(device=self.mean.device, dtype=torch.float64)
        m2_b = var.detach().to(device=self.mean.device, dtype=torch.float64)
        m2_b = m2_b * ((n_b - 1.0).clamp(min=0.0) if unbiased else n_b)
        total = self.count + n_b
        share = n_b / total.clamp(min=1.0)
        delta = mean_b - self.mean
        self.mean.add_(delta * share)
        self.m2.add_(m2_b + delta * delta * (self.count * share))
        self.count.copy_(total)

    def result(self) -> tuple[float, Tensor, Tensor]:
        """``(count, mean, m2)`` of every batch added (float64; reads the count on the host)."""
        traced = float(self.count.item())  # batches merged while compiled (usually none or all)
        if not self.batches:
            return traced, self.mean, self.m2
        device = self.mean.device
        counts = torch.stack(
            [torch.as_tensor(c, dtype=torch.float64, device=device) for c, _ in self.batches]
        )
        stats = torch.stack([s for _, s in self.batches]).to(device=device, dtype=torch.float64)
        self.batches = []
        counts = counts.view(-1, 1)
        total = counts.sum()
        n = float(total.item())
        mean = (counts * stats[:, 0]).sum(0) / max(n, 1.0)
        m2 = (counts * (stats[:, 1] + (stats[:, 0] - mean).square())).sum(0)
        if traced == 0.0:
            return n, mean, m2
        self._merge(total, mean, m2 / max(n, 1.0), False)
        return traced + n, self.mean, self.m2


def observe(
    running_mean: Tensor | None,
    count: float | Tensor,
    mean: Tensor,
    var: Tensor,
    momentum: float | Tensor,
    *,
    unbiased: bool = False,
    local: bool = False,
) -> None:
    """Tell a listening block about a batch's global moments, where the engine updates ``running_mean``. A
    ``momentum`` of exactly 0 (a recomputation) is ignored; ``local``: DataParallel replicas' moments."""
    if not _listeners or running_mean is None or (isinstance(momentum, float) and momentum == 0.0):
        return
    moments = listening(running_mean)
    if moments is not None:
        moments.add(count, mean, var, unbiased)
        moments.local = moments.local or local


def listening(running_mean: Tensor) -> Moments | None:
    """The moments collecting ``running_mean``'s updates, or ``None``."""
    moments = _listeners.get(id(running_mean))
    return moments if moments is not None and moments.running_mean is running_mean else None


def listen(running_mean: Tensor) -> Moments:
    """Start collecting the updates of ``running_mean``; raises if already collected."""
    if listening(running_mean) is not None:
        raise RuntimeError(
            "syncbn.accumulation: this layer is already inside another accumulation block "
            "(expected one block per layer at a time, got a nested one)"
        )
    moments = Moments(running_mean)
    _listeners[id(running_mean)] = moments
    return moments


def stop(moments: Moments) -> None:
    """Stop collecting for ``moments`` (no error if it already stopped)."""
    key = id(moments.running_mean)
    if _listeners.get(key) is moments:
        del _listeners[key]
