"""Layer families: their math only, through the protocol of :mod:`._protocol` (docs/architecture.md)."""

from .batchnorm import BATCH_NORM, BatchNorm
from .renorm import Renorm

__all__ = ["BATCH_NORM", "BatchNorm", "Renorm"]
