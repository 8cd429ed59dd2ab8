"""Support code for other libraries' layers; each submodule imports its library and is imported lazily.

:mod:`~syncbn.integrations.timm` (timm's ``BatchNormAct2d``), :mod:`~syncbn.integrations.mmengine`
(names in mmengine's ``MODELS``), :mod:`~syncbn.integrations.lightning` (also :mod:`syncbn.lightning`)."""

from __future__ import annotations

__all__ = ["missing"]


def missing(library: str, exc: ImportError) -> ImportError:
    """The error an integration module raises when its library (an extra of syncbn's) is not installed."""
    return ImportError(
        f"syncbn.integrations.{library} needs {library} (pip install 'syncbn[{library}]'); got: {exc}"
    )
