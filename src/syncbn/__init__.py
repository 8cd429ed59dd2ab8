"""syncbn: exact Synchronized Batch Normalization for PyTorch, everywhere you train."""

from . import functional, parallel
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d

__version__ = "0.1.0"

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNorm1d",
    "SyncBatchNorm2d",
    "SyncBatchNorm3d",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "functional",
    "parallel",
    "__version__",
]
