"""One exact running-statistics update per optimizer step under gradient accumulation.

How the micro-batches' moments are collected and merged: docs/internals/tools.md.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _accumulating, groups
from ._abn_layer import ActivatedBatchNormBase
from ._layer import LayerMixin
from .engine import _rules
from .modules import SyncBatchNorm

__all__ = ["accumulation"]


def _is_local(layer: nn.Module) -> bool:
    """Whether the layer's training forward runs without a collective (where the hooks must look)."""
    if isinstance(layer, ActivatedBatchNormBase) and layer._local:
        return True
    if isinstance(layer, SyncBatchNorm) and layer._family_call() is not None:
        return False  # a family (renorm) runs the engine even without a group: the engine shows it
    if isinstance(layer, LayerMixin):
        return _group(layer) is None
    if isinstance(layer, nn.SyncBatchNorm):
        raise TypeError(
            "syncbn.accumulation: expected syncbn's layers or plain BatchNorm "
            f"(got torch.nn.SyncBatchNorm, {type(layer).__name__}); convert the model with "
            "syncbn.convert_sync_batchnorm first"
        )
    return True  # plain nn.BatchNorm*: always local


def _group(layer: nn.Module) -> Any:
    """The group the layer's training calls synchronise over (``None``: local)."""
    if not isinstance(layer, LayerMixin) or (isinstance(layer, ActivatedBatchNormBase) and layer._local):
        return None
    return groups.resolve(layer._group())


def _varies(layer: nn.Module) -> bool:
    """Whether the layer's path can change from call to call without a group: a family whose
    attributes choose batch norm's local path (renorm at ``r_max=1, d_max=0``) or the engine."""
    return (
        isinstance(layer, SyncBatchNorm)
        and type(layer)._family_call is not SyncBatchNorm._family_call
        and _group(layer) is None
    )


def _local_moments(x: Tensor, mask: Tensor | None) -> tuple[int, Tensor, Tensor] | None:
    """``(count, mean, biased var)`` per channel of ``x`` (valid positions of ``mask``), float64."""
    channels = x.shape[1]
    values = x.detach().movedim(1, -1)
    values = values[mask] if mask is not None else values.reshape(-1, channels)
    count = values.shape[0]
    if count == 0 or channels == 0:
        return None
    var, mean = torch.var_mean(values.to(torch.float64), dim=0, correction=0)
    return count, mean, var


class _Layer:
    """One layer's state in a block: the snapshot to restore and the moments merged so far."""

    def __init__(self, layer: nn.Module) -> None:
        local = _is_local(layer)  # may refuse the layer: before anything is registered
        # A layer whose path is chosen per call (renorm without a group): its hooks ask each call.
        self.varies = _varies(layer)
        self.layer = layer
        running_mean, running_var = layer.running_mean, layer.running_var
        assert isinstance(running_mean, Tensor) and isinstance(running_var, Tensor)
        self.running_mean, self.running_var = running_mean, running_var
        self.mean0 = running_mean.detach().clone()
        self.var0 = running_var.detach().clone()
        tracked = layer.num_batches_tracked
        # (num_batches_tracked, its value at begin), or None
        self.batches = (tracked, tracked.detach().clone()) if isinstance(tracked, Tensor) else None
        self.moments = _accumulating.listen(running_mean)
        self.pending: tuple[int, Tensor, Tensor] | None = None
        self.hooks: list[Any] = []
        if local or self.varies:
            self.hooks.append(layer.register_forward_pre_hook(self._before, with_kwargs=True))
            self.hooks.append(layer.register_forward_hook(self._after))

    def _before(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.pending = None
        if not layer.training or getattr(layer, "freeze", False) or not layer.track_running_stats:
            return
        if not _rules.is_compiling() and _rules.in_backward():  # torch.utils.checkpoint recomputing
            return
        if layer.__dict__.get("_syncbn_replica") is not None or not args or not isinstance(args[0], Tensor):
            return
        if self.varies and isinstance(layer, SyncBatchNorm) and layer._family_call() is not None:
            return  # this call runs the engine, which reports its moments itself
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        self.pending = _local_moments(args[0], mask)

    def _after(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.pending is not None:
            self.moments.add(*self.pending)
            self.pending = None

    def close(self, commit: bool) -> None:
        """Stop listening; put the statistics back, then (``commit``) apply the one merged update."""
        for hook in self.hooks:
            hook.remove()
        _accumulating.stop(self.moments)
        with torch.no_grad():
            self.running_mean.copy_(self.mean0)
            self.running_var.copy_(self.var0)
            if self.batches is not None:
                tracked, before = self.batches
                ran = not torch.equal(tracked, before)
                tracked.copy_(before)
                if commit and ran:
                    tracked.add_(1)
            if not commit:
                return
            count, mean, m2 = self.moments.result()
            if count <= 0.0:
                return
            momentum: Any = self.layer.momentum
            if momentum is None:  # cumulative moving average, this update included
                seen = float(self.batches[0].item()) if self.batches is not None else 1.0
                factor = 1.0 / max(seen, 1.0)
            else:
                factor = float(momentum)
            unbiased = m2 / max(count - 1.0, 1.0)
            for running, batch in ((self.running_mean, mean), (self.running_var, unbiased)):
                running.lerp_(batch.to(running.dtype), factor)


def _layers(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    for layer in model.modules():
        if isinstance(layer, (_BatchNorm, ActivatedBatchNormBase)):
            if layer.track_running_stats and isinstance(layer.running_mean, Tensor):
                found.append(layer)
    return found


class accumulation:  # noqa: N801 - used like torch.no_grad
    """One exact running-statistics update for all micro-batches of a gradient-accumulation step.

    Use it around the ``k`` forward/backward passes of one optimizer step.
    Inside, every batch-norm layer of ``model`` normalises each micro-batch
    with that micro-batch's statistics (synchronised as always). When the block
    ends, each layer's ``running_mean`` and ``running_var`` take **one** momentum
    update with the mean and unbiased variance of all micro-batches of all ranks
    together, and ``num_batches_tracked`` goes up by one: exactly what one
    training forward over the concatenated ``k x W`` micro-batches would leave
    (``momentum=None`` included). An exception inside the block leaves the
    running statistics and ``num_batches_tracked`` as they were before it.

    No collective is added: the block merges the global moments the layers
    already sum (in float64, Chan's formulas), so the ranks' statistics stay
    identical. Covers syncbn's layers and plain ``nn.BatchNorm*`` (local, seen
    by a forward pre-hook); ``torch.nn.SyncBatchNorm`` is refused (convert the
    model first).

    Args:
        model: the module whose batch-norm layers accumulate (DDP wrappers and
            the like too: every submodule is searched).

    Example::

        >>> import torch, syncbn
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8))
        >>> with syncbn.accumulation(model):
        ...     for micro in torch.randn(4, 2, 3, 8, 8):   # 4 micro-batches of 2
        ...         model(micro).square().mean().backward()
        >>> int(model[1].num_batches_tracked)              # one update per optimizer step
        1

    A training loop's hooks can also drive it by hand: :meth:`begin`, then
    :meth:`commit` or :meth:`discard`.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"syncbn.accumulation: expected an nn.Module (got {type(model).__name__})")
        self.model = model
        self._open: list[_Layer] | None = None

    @property
    def active(self) -> bool:
        """Whether the block is collecting (between :meth:`begin` and :meth:`commit`/:meth:`discard`)."""
        return self._open is not None

    def begin(self) -> accumulation:
        """Snapshot the running statistics and start collecting the micro-batches' moments."""
        if self._open is not None:
            raise RuntimeError(
                "syncbn.accumulation: begin() called twice (expected commit() or discard() between)"
            )
        opened: list[_Layer] = []
        try:
            for layer in _layers(self.model):
                opened.append(_Layer(layer))
        except BaseException:
            for state in opened:
                state.close(commit=False)
            raise
        self._open = opened
        return self

    def commit(self) -> None:
        """Apply the one update with every micro-batch seen since :meth:`begin`, and stop."""
        self._close(commit=True)

    def discard(self) -> None:
        """Put the running statistics back as they were at :meth:`begin`, and stop."""
        self._close(commit=False)

    def _close(self, commit: bool) -> None:
        opened, self._open = self._open, None
        if opened is None:
            raise RuntimeError("syncbn.accumulation: not collecting (expected begin() first)")
        for state in opened:
            state.close(commit)

    def __enter__(self) -> accumulation:
        return self.begin()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._close(commit=kind is None)
