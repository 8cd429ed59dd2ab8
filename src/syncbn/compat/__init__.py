"""Drop-in APIs for code written against earlier synchronized batch norms.

* :mod:`syncbn.compat.sync_batchnorm`: the ``sync_batchnorm`` package
  (Synchronized-BatchNorm-PyTorch): ``SynchronizedBatchNorm1d/2d/3d``,
  ``DataParallelWithCallback``, ``patch_replication_callback``, ``convert_model``.
* :mod:`syncbn.compat.megengine`: MegEngine's ``SyncBatchNorm`` (its momentum
  convention, ``freeze`` and ``group``).
* :mod:`syncbn.compat.inplace_abn`: the ``inplace-abn`` package (InPlace-ABN):
  ``ABN``, ``InPlaceABN``, ``InPlaceABNSync``, ``inplace_abn``, ``inplace_abn_sync``.

Existing code changes only its import line. The first two are thin layers over
:class:`syncbn.SyncBatchNorm`: they synchronise wherever it does and compute
exactly what it computes. ``docs/migration.md`` lists every difference.
"""

from . import inplace_abn, megengine, sync_batchnorm

__all__ = ["inplace_abn", "megengine", "sync_batchnorm"]
