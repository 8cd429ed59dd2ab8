"""The synchronised form of timm's ``BatchNormAct2d`` (batch norm, then dropout and activation).

Imported by :func:`syncbn.convert_sync_batchnorm` only when a model holds one (or timm's
``SyncBatchNormAct``), so syncbn never imports timm otherwise. Needs ``pip install "syncbn[timm]"``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..modules import SyncBatchNorm, SyncBatchNorm2d
from . import missing

try:
    from timm.layers.norm_act import BatchNormAct2d, SyncBatchNormAct
except ImportError as exc:  # pragma: no cover - only without timm
    raise missing("timm", exc) from exc

__all__ = ["SyncBatchNormAct2d", "BatchNormAct2d", "SyncBatchNormAct"]


class SyncBatchNormAct2d(SyncBatchNorm2d, BatchNormAct2d):  # type: ignore[misc]
    """timm's ``BatchNormAct2d`` with syncbn's synchronised batch norm.

    Batch norm over every rank's batch, then the layer's ``drop`` and ``act`` modules (with ``mask=``,
    see :meth:`syncbn.SyncBatchNorm.forward`, after the masked batch norm: padded positions hold
    ``act(drop(0))``, 0 for ReLU, SiLU, GELU, hard-swish). Both a :class:`syncbn.SyncBatchNorm2d` and a
    timm ``BatchNormAct2d``, so timm's utilities (``freeze_batch_norm_2d``, ...) recognise it;
    :func:`syncbn.convert_sync_batchnorm` makes it from a ``BatchNormAct2d`` (keeping every attribute)
    and :func:`syncbn.revert_sync_batchnorm` turns it back into that very class.

    Args:
        *args: as ``timm.layers.BatchNormAct2d``.
        process_group: ``torch.distributed`` group; ``None`` is the default group.
        **kwargs: as ``timm.layers.BatchNormAct2d``.

    Shape:
        - Input: :math:`(N, C, H, W)`
        - Output: same as input.

    Example::

        >>> import timm, syncbn
        >>> model = syncbn.convert_sync_batchnorm(timm.create_model("efficientnet_b0"))
        >>> type(model.bn1).__name__
        'SyncBatchNormAct2d'
    """

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        BatchNormAct2d.__init__(self, *args, **kwargs)
        template = SyncBatchNorm(1, process_group=process_group, device="meta")
        for key in ("process_group", "freeze", "_syncbn_state"):
            self.__dict__[key] = template.__dict__[key]

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        x = SyncBatchNorm.forward(self, input, mask)
        x = self.drop(x)
        return self.act(x)  # type: ignore[no-any-return]
