"""syncbn: exact Synchronized Batch Normalization for PyTorch, everywhere you train."""

from . import functional, parallel
from ._checks import name_layers
from ._config import (
    debug_enabled,
    get_timeout,
    set_debug,
    set_shared_memory,
    set_timeout,
    shared_memory_enabled,
)
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .groups import CollectiveError
from .join import JoinableSyncBatchNorm
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
    "set_timeout",
    "get_timeout",
    "set_debug",
    "debug_enabled",
    "set_shared_memory",
    "shared_memory_enabled",
    "name_layers",
    "CollectiveError",
    "JoinableSyncBatchNorm",
    "__version__",
]
