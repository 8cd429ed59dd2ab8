"""syncbn: exact Synchronized Batch Normalization for PyTorch, everywhere you train."""

from . import functional, parallel
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d

__version__ = "0.1.0"

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNorm1d",
    "SyncBatchNorm2d",
    "SyncBatchNorm3d",
    "functional",
    "parallel",
    "__version__",
]
