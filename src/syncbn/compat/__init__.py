"""Drop-in APIs for code written against earlier synchronized batch norms: change the import line.

:mod:`~syncbn.compat.sync_batchnorm` (Synchronized-BatchNorm-PyTorch), :mod:`~syncbn.compat.megengine`
(MegEngine), :mod:`~syncbn.compat.inplace_abn` (InPlace-ABN). docs/migration.md lists every difference.
"""

from . import inplace_abn, megengine, sync_batchnorm

__all__ = ["inplace_abn", "megengine", "sync_batchnorm"]
