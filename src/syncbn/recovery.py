"""Re-aligning the ranks' batch-norm buffers after a failed collective (docs/robustness.md, "Recovery")."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from ._abn_layer import ActivatedBatchNormBase
from .groups import PHASE_OTHER, CollectiveError, ProcessGroupSum, Tag, resolve

__all__ = ["sync_buffers"]

_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def layout_checksum(entries: Iterable[str]) -> int:
    """CRC-32 of the layers' names and sizes: equal on ranks whose models hold the same layers."""
    return zlib.crc32(";".join(entries).encode())


def _norm_buffers(model: nn.Module) -> tuple[list[Tensor], Tag]:
    """The normalisation layers' buffers, in module order, and the call's tag (their layout's checksum)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    buffers: list[Tensor] = []
    layout = ["syncbn.sync_buffers"]
    for name, module in model.named_modules():  # each module once
        if isinstance(module, (_NormBase, ActivatedBatchNormBase)):
            for key in _NAMES:
                buf = getattr(module, key, None)
                if isinstance(buf, Tensor):
                    buffers.append(buf)
                    layout.append(f"{name}.{key}:{tuple(buf.shape)}")
    return buffers, Tag(layout_checksum(layout) & 0x7FFFFFFF, PHASE_OTHER)


@torch.no_grad()
def sync_buffers(model: nn.Module, src: int = 0, process_group: Any = None) -> int:
    """Copy rank ``src``'s batch-norm buffers to every rank of the group.

    Every normalisation layer of ``model`` with running statistics (``syncbn.SyncBatchNorm*``,
    ``syncbn.InPlaceSyncBatchNorm*``, the ``syncbn.compat.inplace_abn`` layers, ``nn.BatchNorm*d``,
    ``nn.InstanceNorm*d`` with ``track_running_stats=True``) takes ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` from rank ``src``, for instance after a :class:`~syncbn.CollectiveError`. The
    values travel as one framed float64 sum (exact for float16/bfloat16/float32 values and counts below
    ``2**53``) whose header carries a checksum of the layers' names and the buffers' shapes, so models that
    differ between ranks (even with equal total sizes) give a ``CollectiveError`` (``mismatch``) on every
    rank, naming both sizes, and no buffer changes. A collective: call it on every rank. Parameters are not
    touched (DDP broadcasts them at construction).

    Args:
        model: the model (``DistributedDataParallel``/``DataParallel`` wrappers are looked through).
        src: the group rank whose buffers every rank takes.
        process_group: the group, ``None`` for the default group. A group whose collective timed
            out or failed is unusable: pass a new one.

    Returns:
        The number of buffers synchronised (0 without a process group, or in a group of one).

    Raises:
        ValueError: ``src`` is not a rank of the group.
        CollectiveError: the ranks' models have different buffers (names, shapes), or the
            collective timed out or failed.

    Example::

        >>> try:
        ...     train_step(model, batch)
        ... except syncbn.CollectiveError as exc:
        ...     if not exc.mismatch:                       # the group is unusable: a new one
        ...         torch.distributed.destroy_process_group()
        ...         torch.distributed.init_process_group("gloo")
        ...     syncbn.sync_buffers(model)                 # every rank: equal buffers again
    """
    group = resolve(process_group)
    buffers, tag = _norm_buffers(model)
    if not isinstance(group, ProcessGroupSum):
        return 0
    if not 0 <= src < group.size:
        raise ValueError(f"sync_buffers: src must be a rank of the group, in [0, {group.size}) (got {src})")
    device = buffers[0].device if buffers else None
    empty = torch.zeros(0, dtype=torch.float64, device=device)
    flat = torch.cat([empty, *(b.detach().reshape(-1).to(device, torch.float64) for b in buffers)])
    if group.rank != src:
        flat.zero_()
    try:
        group.all_reduce_sum_bounded(flat, host_wait=True, tag=tag)
    except CollectiveError as exc:
        if not exc.mismatch:
            raise
        raise exc._rephrased(
            "syncbn.sync_buffers: the ranks' calls differ (expected the same normalisation layers, "
            "buffer names and shapes on every rank of the group; this rank sent "
            f"{len(buffers)} buffers, {flat.numel()} values); no buffer changed. {exc}",
            timed_out=False,
        ) from exc
    for buf, part in zip(buffers, flat.split([buf.numel() for buf in buffers])):
        buf.copy_(part.view_as(buf))
    return len(buffers)
