"""``nn.DataParallel`` integration, and a small CPU driver that does what it does.

syncbn layers synchronise inside a plain ``nn.DataParallel``, with no wrapper class or callback:
:class:`~syncbn.SyncBatchNorm` enrols each replica through :func:`attach_replica`, the replicas of
a layer sum their moments in replica order (the same bits whatever the threads' timing), replica 0
writes the running statistics into the layer you hold, and one autograd node runs every
replica's backward, so backward never waits for another thread. A replica that never reaches a
layer makes the others raise :class:`ReplicaSyncError` after :func:`get_replica_timeout` seconds.
A single replica is exactly ``nn.BatchNorm``; eval mode and ``freeze=True`` never synchronise;
the layer's ``process_group`` is not used inside replicas.

:func:`data_parallel` takes the same code path on CPU threads (:func:`replicate`, :func:`parallel_apply`, then
concatenation), so tests and examples need no GPU. See docs/how-it-works.md and docs/internals/transports.md.
"""

from .._threads import ReplicaSyncError
from ._driver import data_parallel, parallel_apply, replicate
from ._replication import attach_replica, get_replica_timeout, set_replica_timeout

__all__ = [
    "ReplicaSyncError",
    "attach_replica",
    "data_parallel",
    "get_replica_timeout",
    "parallel_apply",
    "replicate",
    "set_replica_timeout",
]
