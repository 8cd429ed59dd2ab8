"""Support code for other libraries' layers; each submodule imports its library and is imported lazily.

- :mod:`syncbn.integrations.timm`: the synchronised form of timm's ``BatchNormAct2d``,
  used by :func:`syncbn.convert_sync_batchnorm` when a model holds one.
- :mod:`syncbn.integrations.mmengine`: syncbn's layers by name in mmengine's ``MODELS``
  (``"ExactSyncBN"``); :mod:`syncbn.integrations.mmengine_syncbn` makes ``"SyncBN"`` mean them.

- :mod:`syncbn.integrations.lightning`: the Lightning plugin and the accumulation callback, also
  importable as :mod:`syncbn.lightning` (the documented name).
"""

from __future__ import annotations

__all__ = ["missing"]


def missing(library: str, exc: ImportError) -> ImportError:
    """The error an integration module raises when its library (an extra of syncbn's) is not installed."""
    return ImportError(
        f"syncbn.integrations.{library} needs {library} (pip install 'syncbn[{library}]'); got: {exc}"
    )
