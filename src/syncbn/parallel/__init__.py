"""``nn.DataParallel`` integration, and a small CPU driver that does what it does.

How syncbn layers synchronise inside a plain ``nn.DataParallel``
----------------------------------------------------------------
Every forward, ``nn.DataParallel`` replicates the model (``replicate`` calls
``module._replicate_for_data_parallel()`` once per replica for every module),
runs replica ``k`` on chunk ``k`` of the batch in thread ``k``, and gathers.

1. **Replication** (:mod:`syncbn.parallel._replication`).
   :class:`~syncbn.SyncBatchNorm` overrides ``_replicate_for_data_parallel``
   to call :func:`attach_replica`, which gives the replicas of one layer made
   by one ``replicate`` call a shared *replication*: a
   :class:`~syncbn._threads.Rendezvous` of as many members as there are
   replicas, each replica knowing its index. No wrapper class and no callback
   are needed. :func:`replicate` below says which call and index a replica
   belongs to; for ``torch.nn.parallel.replicate`` the replicas of a layer are
   the run of back-to-back enrolments made in one thread, which a new
   replication starts when the previous one has run a forward, when one of its
   replicas has been freed (the last ``nn.DataParallel`` forward is over), or
   when another layer was enrolled in between.
2. **Forward** (:mod:`syncbn.parallel._joint`). Replica ``k`` computes its
   chunk's moments (the same math as the multi-process path,
   :mod:`syncbn.engine._math`), and a :class:`~syncbn._threads.ThreadSumGroup` sums the
   packed moments over the replicas in replica order, so every replica gets the
   same bits whatever the threads' timing. Each replica normalises its own
   chunk in its own thread. Replica 0 then writes the updated running
   statistics (identical on every replica) into the layer the user holds: they
   are not lost with the replicas.
3. **One autograd node for all replicas** (:mod:`syncbn.parallel._joint`). The
   replicas' outputs are joined into a single autograd node (a second, cheap
   rendezvous). Its backward receives every replica's output gradient at once,
   sums the per-replica ``[sum(dy), sum(dy*xhat)]`` in replica order and returns
   each replica's input gradient and its *local share* of the weight/bias
   gradients (``nn.DataParallel`` sums those into the original parameters).
   Backward therefore never waits for another thread: on CPU the autograd
   engine runs every replica's backward in the one thread that called
   ``backward()``, one node after another, so a backward that blocked until the
   other replicas arrived would deadlock there; on CUDA the node runs on one
   device's autograd thread.
4. **Bounded waits.** A replica that never reaches a layer (a data-dependent
   branch, an exception in its thread) leaves the others waiting; after
   :func:`get_replica_timeout` seconds they raise
   :class:`~syncbn._threads.ReplicaSyncError` naming the layer, never hang.

A single replica is exactly ``nn.BatchNorm``. Eval mode and ``freeze=True``
never synchronise. Inside replicas the layer's ``process_group`` is not used:
the statistics span the replicas of this process.

The CPU driver
--------------
:func:`data_parallel` (:mod:`syncbn.parallel._driver`) splits a batch into
chunks (uneven and empty chunks allowed), :func:`replicate` copies the model the
way ``nn.DataParallel`` does (replicas share the parameters differentiably;
replica 0 shares the buffers), :func:`parallel_apply` runs each replica in its
own thread, and the outputs are concatenated. It needs no GPU: tests and
examples use it to run the very code path ``nn.DataParallel`` takes.
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
