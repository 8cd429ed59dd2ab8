"""syncbn's layers by name in OpenMMLab configs (mmengine's ``MODELS``, mmcv's ``build_norm_layer``).

Importing this module registers the names of :data:`NAMES` in mmengine's root ``MODELS`` registry
(which mmdetection's, mmsegmentation's and mmpretrain's fall back to): ``"ExactSyncBN"`` is
:class:`syncbn.SyncBatchNorm` (any input of 2+ dims, as mmcv's ``"SyncBN"``); with
``"ExactInPlaceSyncBN"`` give the ``ConvModule`` ``act_cfg=None``. A config names them with
``norm_cfg=dict(type="ExactSyncBN", requires_grad=True)`` and
``custom_imports=dict(imports=["syncbn.integrations.mmengine"], allow_failed_imports=False)``.

To make an existing config's ``"SyncBN"`` mean :class:`syncbn.SyncBatchNorm`, opt in with
:func:`replace_syncbn` (or import :mod:`syncbn.integrations.mmengine_syncbn`). Needs ``mmengine``
(``pip install "syncbn[mmengine]"``); mmcv (``mmcv-lite`` is enough) for ``build_norm_layer``.

Example::

    >>> import syncbn.integrations.mmengine
    >>> from mmcv.cnn import build_norm_layer
    >>> name, layer = build_norm_layer(dict(type="ExactSyncBN", requires_grad=True), 64)
    >>> name, type(layer).__name__
    ('bn', 'SyncBatchNorm')
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from ..activated import InPlaceSyncBatchNorm
from ..modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d
from ..renorm import SyncBatchRenorm
from . import missing

try:
    from mmengine.registry import MODELS
except ImportError as exc:  # pragma: no cover - only without mmengine
    raise missing("mmengine", exc) from exc

__all__ = ["NAMES", "register", "replace_syncbn"]

NAMES: dict[str, type[nn.Module]] = {
    "ExactSyncBN": SyncBatchNorm,
    "ExactSyncBN1d": SyncBatchNorm1d,
    "ExactSyncBN2d": SyncBatchNorm2d,
    "ExactSyncBN3d": SyncBatchNorm3d,
    "ExactInPlaceSyncBN": InPlaceSyncBatchNorm,
    "ExactSyncBNRenorm": SyncBatchRenorm,
}

# What "SyncBN" meant before replace_syncbn (mmcv registers torch.nn.SyncBatchNorm under it;
# _ABSENT: not registered, as with mmengine alone).
_replaced: list[Any] = []
_ABSENT = object()


def register() -> None:
    """Register :data:`NAMES` in mmengine's ``MODELS`` (done on import; idempotent).

    Raises:
        KeyError: one of the names is registered already for another class.
    """
    for name, cls in NAMES.items():
        if MODELS.get(name) is not cls:
            MODELS.register_module(name, module=cls)


def replace_syncbn(enable: bool = True) -> None:
    """Make ``"SyncBN"`` in configs build :class:`syncbn.SyncBatchNorm` (``enable=False`` undoes it).

    Process-wide: every later ``build_norm_layer(dict(type="SyncBN"), ...)`` or
    ``MODELS.build(dict(type="SyncBN", ...))`` builds syncbn's layer. Call it on every rank before the
    model is built (a config's ``custom_imports`` of :mod:`syncbn.integrations.mmengine_syncbn` does).

    Args:
        enable: ``True`` to map ``"SyncBN"`` to :class:`syncbn.SyncBatchNorm`, ``False`` to restore what
            it meant before (mmcv's ``torch.nn.SyncBatchNorm``; without mmcv, unregistered again).
    """
    # mmcv registers "SyncBN" (without force) when mmcv.cnn is imported: first, or that would fail.
    if importlib.util.find_spec("mmcv") is not None:
        importlib.import_module("mmcv.cnn")
    current = MODELS.module_dict.get("SyncBN", _ABSENT)
    if enable:
        if current is not SyncBatchNorm:
            _replaced.append(current)
            MODELS.register_module("SyncBN", module=SyncBatchNorm, force=True)
    elif current is SyncBatchNorm and _replaced:
        previous = _replaced.pop()
        if previous is _ABSENT:
            del MODELS._module_dict["SyncBN"]  # unregistered again, as before (mmengine has no API)
        else:
            MODELS.register_module("SyncBN", module=previous, force=True)


register()
