"""syncbn: exact Synchronized Batch Normalization for PyTorch, everywhere you train."""

from . import _config, functional, parallel
from ._checks import name_layers

# The process-wide settings (re-exported explicitly: ``syncbn.__all__`` lists them from ``_config``).
from ._config import debug_enabled as debug_enabled
from ._config import get_timeout as get_timeout
from ._config import set_debug as set_debug
from ._config import set_shared_memory as set_shared_memory
from ._config import set_timeout as set_timeout
from ._config import shared_memory_enabled as shared_memory_enabled
from .accumulate import accumulation
from .activated import InPlaceSyncBatchNorm, InPlaceSyncBatchNorm2d
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .fuse import fuse_batchnorm_activation
from .groups import CollectiveError
from .join import JoinableSyncBatchNorm
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d
from .recovery import sync_buffers
from .renorm import (
    SyncBatchRenorm,
    SyncBatchRenorm1d,
    SyncBatchRenorm2d,
    SyncBatchRenorm3d,
    convert_to_renorm,
)
from .stats import recompute_running_stats, sync_running_stats

try:  # adds syncbn's layer types to torch.ao.quantization's fusion and QAT tables
    from . import quantization
except ImportError:  # pragma: no cover - a torch without torch.ao.quantization's eager modules
    pass

__version__ = "0.1.0"

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNorm1d",
    "SyncBatchNorm2d",
    "SyncBatchNorm3d",
    "InPlaceSyncBatchNorm",
    "InPlaceSyncBatchNorm2d",
    "SyncBatchRenorm",
    "SyncBatchRenorm1d",
    "SyncBatchRenorm2d",
    "SyncBatchRenorm3d",
    "convert_to_renorm",
    "fuse_batchnorm_activation",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "sync_running_stats",
    "recompute_running_stats",
    "functional",
    "parallel",
    "quantization",
    *(name for name in _config.__all__ if name != "DEFAULT_TIMEOUT_S"),  # the settings, in order
    "name_layers",
    "CollectiveError",
    "sync_buffers",
    "accumulation",
    "JoinableSyncBatchNorm",
    "__version__",
]
