"""Drop-in APIs for code written against earlier synchronized batch norms.

* :mod:`syncbn.compat.sync_batchnorm`: the ``sync_batchnorm`` package
  (Synchronized-BatchNorm-PyTorch): ``SynchronizedBatchNorm1d/2d/3d``,
  ``DataParallelWithCallback``, ``patch_replication_callback``, ``convert_model``.
* :mod:`syncbn.compat.megengine`: MegEngine's ``SyncBatchNorm`` (its momentum
  convention, ``freeze`` and ``group``).

Existing code changes only its import line. Both are thin layers over
:class:`syncbn.SyncBatchNorm`: they synchronise wherever it does and compute
exactly what it computes. ``docs/migration.md`` lists every difference.
"""

from . import megengine, sync_batchnorm

__all__ = ["megengine", "sync_batchnorm"]
