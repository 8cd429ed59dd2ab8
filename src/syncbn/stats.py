"""Running statistics for a whole model: merge them across ranks, or recompute them exactly from data.

Both functions work on any BatchNorm layer (``nn.BatchNorm*d``, syncbn's layers, the in-place
ones included, timm's ``BatchNormAct2d``, ...) and leave every rank with identical buffers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_leaves

from . import groups
from ._abn_layer import ActivatedBatchNormBase
from ._accumulating import Moments
from ._layer import check_module
from .recovery import layout_checksum

__all__ = ["sync_running_stats", "recompute_running_stats"]

# A layer with BatchNorm's running statistics: torch's, or an in-place activated one of syncbn's.
_Tracked = Union[_BatchNorm, ActivatedBatchNormBase]


def _tracked_layers(model: nn.Module, function: str) -> list[tuple[str, _Tracked]]:
    """The model's BatchNorm layers (the in-place activated ones too) that keep running statistics."""
    check_module(model, function)
    return [
        (name, mod)
        for name, mod in model.named_modules()  # each module once (named_modules skips repeats)
        if isinstance(mod, (_BatchNorm, ActivatedBatchNormBase))
        and mod.running_mean is not None
        and mod.running_var is not None
    ]


def _sum_checked(
    group: Any, layers: list[tuple[str, _Tracked]], parts: list[Tensor], function: str
) -> tuple[int, Tensor]:
    """The group size and the float64 ``parts`` summed over ``group`` (on the last part's device), after
    a header ``[1, layout code in [0, 1)]``: raises on every rank when the ranks' layers differ."""
    own = layout_checksum(f"{name}:{layer.running_mean.numel()}" for name, layer in layers) / 2**32  # type: ignore[union-attr]
    device = parts[-1].device if parts else torch.device("cpu")
    packed = torch.cat(
        [torch.tensor([1.0, own], dtype=torch.float64, device=device)] + [p.to(device) for p in parts]
    )
    if group is None:
        return 1, packed[2:]
    try:
        group.all_reduce_sum(packed)
    except groups.CollectiveError as exc:
        if not exc.mismatch:
            raise
        batches = (
            ", and with syncbn layers the same number of batches" if function.startswith("recompute") else ""
        )
        raise exc._rephrased(  # unequal sizes, or a rank still in a layer's collective
            f"syncbn.{function}: the ranks' calls differ (expected the same BatchNorm layers, names "
            f"and channel counts, on every rank of the group{batches}; this rank sent "
            f"{packed.numel()} values); no running statistics changed. {exc}"
        ) from exc
    size = int(round(packed[0].item()))
    if abs(packed[1].item() - size * own) > 1e-9 * size:
        raise ValueError(
            f"syncbn.{function}: the ranks' models hold different BatchNorm layers (expected the same "
            f"layer names and channel counts on all {size} ranks, got layer layouts that differ)"
        )
    return size, packed[2:]


def sync_running_stats(model: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm layer's running statistics by their merge over the ranks.

    For a model trained with per-rank (unsynchronised) BatchNorm, or whose ranks drifted apart:
    afterwards every rank holds the running mean and variance of the mixture of all ranks' data,
    rank :math:`r`'s weighted by :math:`w_r`, the batches it has seen (``num_batches_tracked``):

    .. math::
        \\mu = \\frac{\\sum_r w_r \\mu_r}{\\sum_r w_r}, \\qquad
        \\sigma^2 = \\underbrace{\\frac{\\sum_r w_r \\sigma_r^2}{\\sum_r w_r}}_{\\text{within ranks}}
          + \\underbrace{\\frac{\\sum_r w_r (\\mu_r - \\mu)^2}{\\sum_r w_r}}_{\\text{between ranks}}

    (the law of total variance), applied to the stored ``running_var``. BatchNorm stores the *unbiased*
    variance and counts batches, not samples, so for :math:`n` values per channel on each rank the result
    differs from the unbiased variance of all ranks' values by less than :math:`1/n` of the variance (derived
    in docs/statistics.md; for the statistics of the data themselves, use :func:`recompute_running_stats`). A
    rank that has seen no batch carries no weight; where no rank has seen one, or a layer keeps no
    ``num_batches_tracked``, the ranks weigh equally. (``timm.utils.distribute_bn`` averages the variances
    alone, dropping the between-rank part.) All layers travel in one float64 ``all_reduce``. Each
    ``num_batches_tracked`` becomes the mean over ranks, rounded. Every rank of the group must call this;
    outside ``torch.distributed``, or in a group of one, the model is returned unchanged.

    Args:
        model: the model (or a single layer): every ``_BatchNorm`` layer with running statistics takes
            part, and syncbn's in-place activated ones (``syncbn.compat.inplace_abn``'s too).
        process_group: the ``torch.distributed`` group to merge over; ``None`` is the default group.

    Returns:
        ``model``, its running statistics updated in place.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the ranks' models hold different BatchNorm layers of equal total size.
        syncbn.CollectiveError: the collective failed or timed out, or (``mismatch``) the
            ranks' layers differ in total size; nothing changed.

    Example::

        >>> # every rank, after training with plain nn.BatchNorm under DDP
        >>> syncbn.sync_running_stats(model)
        >>> if rank == 0:
        ...     torch.save(model.state_dict(), "model.pt")   # the merged statistics
    """
    layers = _tracked_layers(model, "sync_running_stats")
    group = groups.resolve(process_group)
    if group is None:
        return model
    parts: list[Tensor] = []
    for _, layer in layers:
        mean = layer.running_mean.detach().to(torch.float64)  # type: ignore[union-attr]
        second = layer.running_var.detach().to(torch.float64) + mean * mean  # type: ignore[union-attr]
        tracked = layer.num_batches_tracked
        w = tracked.to(mean).reshape(1) if tracked is not None else mean.new_ones(1)
        # [w, w*mean, w*(var + mean^2)], then the unweighted [mean, var + mean^2] for all-zero weights
        parts += [w, w * mean, w * second, mean, second]
    size, packed = _sum_checked(group, layers, parts, "sync_running_stats")
    chunks = packed.split([1 + 4 * layer.running_mean.numel() for _, layer in layers])  # type: ignore[union-attr]
    with torch.no_grad():
        for (_, layer), chunk in zip(layers, chunks):
            w = chunk[0]
            s1, s2, u1, u2 = chunk[1:].split(layer.running_mean.numel())  # type: ignore[union-attr]
            total = float(w.item())
            mean, second = (s1 / w, s2 / w) if total > 0 else (u1 / size, u2 / size)
            layer.running_mean.copy_(mean)  # type: ignore[union-attr]
            layer.running_var.copy_((second - mean * mean).clamp_min(0.0))  # type: ignore[union-attr]
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.fill_(int(round(total / size)))
    return model


def _storage(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return 0


def _with_progress(batches: Iterable[Any], enabled: bool) -> Iterator[Any]:
    """``batches``, with a one-line progress bar on stderr (``enabled``) redrawn at most 10 times a second."""
    try:  # a DataLoader of an IterableDataset has a __len__ that raises TypeError
        total = len(batches) if enabled else None  # type: ignore[arg-type]
    except TypeError:
        total = None
    start, last, done = time.monotonic(), 0.0, 0

    def draw(now: float, end: str) -> None:
        counted = f" [{'#' * (30 * min(done, total) // total):-<30}] {done}/{total}" if total else f": {done}"
        sys.stderr.write(f"\rsyncbn.recompute_running_stats{counted} batches, {now - start:.1f}s{end}")
        sys.stderr.flush()

    for batch in batches:
        yield batch
        done += 1
        now = time.monotonic()
        if enabled and now - last >= 0.1:
            last = now
            draw(now, "")
    if enabled:
        draw(time.monotonic(), "\n")


@torch.no_grad()
def recompute_running_stats(
    model: nn.Module,
    batches: Iterable[Any],
    process_group: Any = None,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    progress: bool | None = None,
) -> nn.Module:
    """Set every BatchNorm layer's running statistics to the exact statistics of the given data.

    Runs ``model`` in training mode, without gradients, over ``batches`` on every rank, and sets each
    BatchNorm layer's ``running_mean`` and ``running_var`` to the mean and unbiased variance of everything
    that reached it over all batches of all ranks (merged exactly in float64): the population statistics, not
    an average of per-batch ones. Masked calls count their valid positions only. The in-place activated layers
    take part too; one handed a tensor of a batch (or a view of it) works on a copy, so the batches are never
    written over. syncbn layers normalise over all ranks' batches, so every rank must then pass the same
    number of batches. Modes and ``num_batches_tracked`` are restored afterwards (on an error, the running
    statistics too). Layers no value reached, and frozen syncbn layers, keep their statistics (a layer a
    single value reached keeps its variance). See docs/statistics.md.

    Args:
        model: the model; pass the module itself rather than a DDP wrapper.
        batches: an iterable of batches (a ``DataLoader``, a list of tensors), each passed to ``forward``.
        process_group: the ``torch.distributed`` group whose batches count together; ``None`` is the
            default group. Outside ``torch.distributed``, the statistics are this process's.
        forward: how to run the model on a batch (default ``model(batch)``; ``lambda m, b: m(b[0])``: pairs).
        progress: draw a progress bar on stderr (the group's rank 0); ``None``: where stderr is a terminal.

    Returns:
        ``model``, its running statistics set in place to those of ``batches``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the ranks' models hold different BatchNorm layers of equal total size.
        syncbn.CollectiveError: a collective failed or timed out, or (``mismatch``) the ranks'
            layers differ in total size; the running statistics are as before.

    Example::

        >>> loader = torch.utils.data.DataLoader(train_set, batch_size=64)   # this rank's shard
        >>> syncbn.recompute_running_stats(model, (x for x, _ in loader))
        >>> model.eval()   # every rank now holds the statistics of the whole training set
    """
    layers = _tracked_layers(model, "recompute_running_stats")
    layers = [(name, layer) for name, layer in layers if not getattr(layer, "freeze", False)]
    group = groups.resolve(process_group)
    run = forward if forward is not None else (lambda m, batch: m(batch))
    moments = {id(layer): Moments(layer.running_mean) for _, layer in layers}  # type: ignore[arg-type]

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args and isinstance(args[0], Tensor):  # the input it normalises: where a mask is, (M, C) valid
            mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
            x = args[0].movedim(1, -1)[mask] if isinstance(mask, Tensor) else args[0]
            values = x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1)
            if values.shape[1]:  # an empty batch adds nothing
                moments[id(module)].add(values.shape[1], values.mean(1), values.var(1, unbiased=False))

    feeding: set[int] = set()  # the storages of the batch being run (nested in containers too)

    def protect(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # An in-place layer handed the caller's batch (or a view of it) would write over it: a copy.
        if args and isinstance(args[0], Tensor) and _storage(args[0]) in feeding:
            return (args[0].clone(), *args[1:])
        return None

    modes = [(mod, mod.training) for mod in model.modules()]
    saved = [(t, t.clone()) for _, layer in layers for t in (layer.running_mean, layer.running_var)]  # type: ignore[union-attr]
    counters = [(t, t.clone()) for _, layer in layers if (t := layer.num_batches_tracked) is not None]
    handles = [
        mod.register_forward_pre_hook(protect)
        for mod in model.modules()
        if isinstance(mod, ActivatedBatchNormBase) and mod._in_place
    ]
    handles += [layer.register_forward_pre_hook(hook, with_kwargs=True) for _, layer in layers]
    try:
        show = sys.stderr.isatty() if progress is None else progress
        model.train()
        for batch in _with_progress(batches, bool(show) and (group is None or group.rank == 0)):
            feeding = {_storage(t) for t in tree_leaves(batch) if isinstance(t, Tensor)} - {0}
            run(model, batch)
        _set_population_stats(layers, moments, group)
    except BaseException:
        for tensor, value in saved:
            tensor.copy_(value)  # type: ignore[union-attr]
        raise
    finally:
        for handle in handles:
            handle.remove()
        for mod, training in modes:
            mod.training = training
        for tracked, value in counters:
            tracked.copy_(value)
    return model


def _set_population_stats(
    layers: list[tuple[str, _Tracked]], moments: dict[int, Moments], group: Any
) -> None:
    """Merge each layer's moments across ranks (two float64 all_reduces) and write its running stats."""
    seen = [moments[id(layer)].result() for _, layer in layers]  # (count, mean, m2) of this rank
    first = [torch.cat([mean.new_tensor([count]), count * mean]) for count, mean, _ in seen]
    _, sums = _sum_checked(group, layers, first, "recompute_running_stats")
    if not layers:
        return
    chunks = sums.split([1 + mean.numel() for _, mean, _ in seen])
    means = [chunk[1:] / chunk[0].clamp_min(1.0) for chunk in chunks]
    # Each rank's squared deviations about the global means (no cancellation).
    m2 = torch.cat([own.to(g) + n * (mean.to(g) - g).square() for (n, mean, own), g in zip(seen, means)])
    if group is not None:
        group.all_reduce_sum(m2)
    for (_, layer), chunk, mean, layer_m2 in zip(layers, chunks, means, m2.split([g.numel() for g in means])):
        count = float(chunk[0].item())
        if count == 0:
            continue  # no value reached this layer on any rank: keep its statistics
        layer.running_mean.copy_(mean)  # type: ignore[union-attr]
        if count > 1:  # one value has no unbiased variance: keep the running one
            layer.running_var.copy_(layer_m2 / (count - 1))  # type: ignore[union-attr]
