"""PyTorch Lightning plugin and callback: train with syncbn's synchronized BatchNorm.

``Trainer(sync_batchnorm=True)`` picks ``torch.nn.SyncBatchNorm`` (no CPU, and syncbn's layers turned
back into torch's): pass ``plugins=[syncbn.lightning.SyncBatchNorm()]`` instead. Importing this module
imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``); ``import syncbn`` alone never
does. See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..accumulate import accumulation, check_normalize
from ..convert import convert_sync_batchnorm, revert_sync_batchnorm

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins import LayerSync
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]
        from pytorch_lightning.plugins import LayerSync  # type: ignore[no-redef,assignment]
    except ImportError as exc:
        raise ImportError(
            "syncbn.lightning needs PyTorch Lightning (pip install 'syncbn[lightning]'): "
            "neither lightning.pytorch nor pytorch_lightning could be imported"
        ) from exc

__all__ = ["SyncBatchNorm", "AccumulatedStatistics"]


class SyncBatchNorm(LayerSync):  # type: ignore[misc]
    """Lightning ``LayerSync`` plugin that converts the model with :func:`syncbn.convert_sync_batchnorm`.

    The Trainer calls :meth:`apply` when it sets up a distributed strategy (``ddp``, ``ddp_spawn``, ...)
    and :meth:`revert` when asked to undo it. Whatever the converter keeps is kept (parameters, so
    optimizers stay valid); syncbn layers stay as they are. Works on CPU (gloo) and GPU (NCCL). Do not
    also pass ``sync_batchnorm=True``.

    Args:
        process_group: as :func:`syncbn.convert_sync_batchnorm`; ``None`` (the default group) is looked
            up when the layers run, so the plugin can be built before the processes start.
        group_size: as :func:`syncbn.convert_sync_batchnorm` (``k`` consecutive ranks, or ``"node"``),
            the groups made when the Trainer sets the strategy up, on every rank.
        device_mesh: as :func:`syncbn.convert_sync_batchnorm` (a 1-D ``DeviceMesh`` over its group, a
            multi-dimensional one over all its ranks). Not with the other two.

    Example::

        >>> import lightning.pytorch as L
        >>> import syncbn.lightning
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                     plugins=[syncbn.lightning.SyncBatchNorm()])
        >>> trainer.fit(lit_module, train_loader)
    """

    def __init__(
        self, process_group: Any = None, group_size: int | str | None = None, *, device_mesh: Any = None
    ) -> None:
        self.process_group = process_group
        self.group_size = group_size
        self.device_mesh = device_mesh

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert every BatchNorm layer of ``model`` to a syncbn layer (in place).

        Args:
            model: the LightningModule (or any module).

        Returns:
            The converted model.
        """
        return convert_sync_batchnorm(
            model, self.process_group, group_size=self.group_size, device_mesh=self.device_mesh
        )

    def revert(self, model: nn.Module) -> nn.Module:
        """Turn every syncbn layer of ``model`` back into the class it came from.

        Args:
            model: the LightningModule (or any module).

        Returns:
            The model with plain BatchNorm layers.
        """
        return revert_sync_batchnorm(model)

    def __repr__(self) -> str:
        size = "" if self.group_size is None else f", group_size={self.group_size!r}"
        mesh = "" if self.device_mesh is None else f", device_mesh={self.device_mesh!r}"
        return f"syncbn.lightning.SyncBatchNorm(process_group={self.process_group!r}{size}{mesh})"


class AccumulatedStatistics(Callback):  # type: ignore[misc]
    """Lightning callback: one running-statistics update per optimizer step under gradient accumulation.

    For ``Trainer(accumulate_grad_batches=k)``: a :class:`syncbn.accumulation` block opens at a
    step's first micro-batch and commits in ``on_before_optimizer_step``: one exact update over all
    ranks' micro-batches instead of ``k``. A step Lightning skips leaves its micro-batches to the next
    update; the block also commits at each training epoch's end, and is discarded when training raises.

    Args:
        normalize: the blocks' ``normalize`` (:class:`syncbn.accumulation`): ``"micro-batch"`` (default) or
            ``"cumulative"`` (CmBN: micro-batch ``t`` normalised with all ranks' micro-batches ``1..t``).

    Example::

        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=4,
        ...                     plugins=[syncbn.lightning.SyncBatchNorm()],
        ...                     callbacks=[syncbn.lightning.AccumulatedStatistics()])
    """

    def __init__(self, normalize: str = "micro-batch") -> None:
        check_normalize(normalize)
        self.normalize = normalize
        self.block: accumulation | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        """Open the block at the first micro-batch of an optimizer step."""
        if self.block is None or not self.block.active:
            self.block = accumulation(pl_module, self.normalize).begin()

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        """Apply the one update, after the step's last backward pass."""
        self._close(commit=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: nn.Module) -> None:
        """Apply what is left open at the end of an epoch."""
        self._close(commit=True)

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        """Put the statistics back as they were before the interrupted step."""
        self._close(commit=False)

    def _close(self, commit: bool) -> None:
        block, self.block = self.block, None
        if block is not None and block.active:
            (block.commit if commit else block.discard)()
