"""Which replicas of a layer belong together (one per ``replicate`` call; docs/internals/transports.md)."""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import _checks, groups
from .._config import MAX_TIMEOUT_S
from .._threads import Rendezvous
from ..engine import _rules
from ._joint import replica_batch_norm

_timeout = 120.0


def get_replica_timeout() -> float:
    """Seconds a replica waits for the other replicas at a synchronized layer.

    Returns:
        The current value (default 120).

    Example::

        >>> syncbn.parallel.get_replica_timeout()
        120.0
    """
    return _timeout


def set_replica_timeout(seconds: float) -> float:
    """Set how long a replica waits for the others at a synchronized layer.

    Applies to replications made from now on (each ``nn.DataParallel`` forward makes a new one). When the wait
    runs out, the waiting replicas raise :class:`~syncbn.parallel.ReplicaSyncError` naming the layer.

    Args:
        seconds: a positive number of seconds, at most ``1e9`` (about 31 years). Default: 120.

    Returns:
        The previous value.

    Raises:
        ValueError: not a positive number, or above ``1e9`` (``inf`` included).

    Example::

        >>> old = syncbn.parallel.set_replica_timeout(10.0)
    """
    global _timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"expected a positive number of seconds (got {seconds!r})")
    if not seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"expected at most {MAX_TIMEOUT_S:g} seconds, about 31 years (got {seconds!r})")
    old, _timeout = _timeout, float(seconds)
    return old


class _Replication:
    """The replicas of one layer made by one ``replicate`` call."""

    def __init__(self, master: nn.Module, declared: int | None, root: nn.Module | None) -> None:
        self.master: Any = master  # the layer the user holds
        self.declared = declared  # number of replicas, when syncbn.parallel.replicate said so
        self._members: list[weakref.ref[nn.Module]] = []
        self._root = None if root is None else weakref.ref(root)
        self._rendezvous: Rendezvous | None = None
        self._abandoned: str | None = None  # why a member will never come again
        self._lock = threading.Lock()
        # Made in a backward: a reentrant checkpoint recomputing (its replica threads cannot tell).
        self.recomputing = _rules.in_backward()

    @property
    def expected(self) -> int:
        """Number of replicas: as declared by :func:`syncbn.parallel.replicate`, else enrolled so far."""
        return self.declared if self.declared is not None else len(self._members)

    def being_made(self) -> bool:
        """Whether every member is alive and parameterless (torch's ``replicate`` adds them last)."""
        members = [ref() for ref in self._members]
        return all(m is not None and not m._parameters for m in members)

    def add(self, replica: nn.Module) -> int:
        self._members.append(weakref.ref(replica))
        return len(self._members) - 1

    def rendezvous(self) -> Rendezvous:
        """The replicas' rendezvous; the first call fixes its size."""
        with self._lock:
            if self._rendezvous is None:
                self._rendezvous = Rendezvous(self.expected, _timeout, label=self.describe)
                if self._abandoned is not None:
                    self._rendezvous.abandon(self._abandoned)
                _warn_if_distributed(self.master)
            return self._rendezvous

    def abandon(self, index: int, error: BaseException) -> None:
        """Replica ``index``'s thread ended with ``error``: the others stop waiting for it at once."""
        with self._lock:
            if self._abandoned is None:
                self._abandoned = (
                    f"syncbn: {self.describe()}: replica {index} ended with {type(error).__name__}: "
                    f"{error} (raised in its thread), so it will not reach this layer again"
                )
            rendezvous = self._rendezvous
        if rendezvous is not None:
            rendezvous.abandon(self._abandoned)

    def describe(self) -> str:
        """The layer's name in the replicated model, when known, and its shape."""
        master = self.master
        root = None if self._root is None else self._root()
        if root is not None:
            text = f"{type(master).__name__}({getattr(master, 'num_features', '?')})"
            for name, module in root.named_modules():
                if module is master:
                    return f"layer '{name or type(root).__name__}' ({text})"
        return f"layer {_checks.layer_name(master)}"

    def publish(self, replica: nn.Module) -> None:
        """Copy the replica's running statistics into the layer the user holds."""
        with torch.no_grad():
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                mine, theirs = replica._buffers.get(key), self.master._buffers.get(key)
                if mine is None or theirs is None:
                    continue
                if mine.device != theirs.device or mine.data_ptr() != theirs.data_ptr():  # not shared
                    theirs.copy_(mine)


def _warn_if_distributed(layer: nn.Module) -> None:
    """Warn (once per process) that replicas do not synchronise over the layer's process group."""
    group_of = getattr(layer, "_group", None)
    if group_of is None or not groups.is_initialized():
        return
    try:
        group = groups.resolve(group_of())
    except ValueError:  # not a member of the layer's group: its forward outside replicas says so
        return
    if group is not None and group.size > 1:
        warnings.warn(
            "syncbn: nn.DataParallel replicas synchronise with each other only, within this "
            f"process; the layer's process group ({group.size} ranks) is not used, so each "
            "process normalises with its own batch. Use one process per device under "
            "DistributedDataParallel for statistics over every rank",
            UserWarning,
            stacklevel=2,
        )


def abandon_replica(replica: nn.Module, error: BaseException) -> None:
    """``replica`` (a whole replicated model) ended with ``error``: its layers' siblings stop waiting."""
    for module in replica.modules():
        slot = module.__dict__.get("_syncbn_replica")
        if isinstance(slot, _ReplicaSlot):
            slot.replication.abandon(slot.index, error)


class _ReplicaSlot:
    """What a replica holds: its replication and its index in it."""

    __slots__ = ("replication", "index")

    def __init__(self, replication: _Replication, index: int) -> None:
        self.replication = replication
        self.index = index

    def forward(self, layer: nn.Module, input: Tensor, call: Any, family: Any) -> Tensor:
        return replica_batch_norm(layer, input, call, self.replication, self.index, family)


_open: weakref.WeakKeyDictionary[nn.Module, _Replication] = weakref.WeakKeyDictionary()
_open_lock = threading.Lock()
_local = threading.local()  # .call: the explicit replicate call; .last: the last replication enrolled into


@contextlib.contextmanager
def replicate_call(network: nn.Module, j: int, num_replicas: int) -> Iterator[None]:
    """In this block, replicas made in this thread are replica ``j`` of ``num_replicas`` of ``network``."""
    _local.call = (network, j, num_replicas)
    try:
        yield
    finally:
        _local.call = None


def attach_replica(master: nn.Module, replica: nn.Module) -> None:
    """Enrol ``replica`` (a fresh replica of ``master``) in its replication.

    Called by :meth:`syncbn.SyncBatchNorm._replicate_for_data_parallel`; users do not call it. The replicas of
    ``master`` made by one ``replicate`` call share one rendezvous, replica ``j`` being member ``j``.

    Args:
        master: the layer being replicated (the one the user holds).
        replica: the new replica.

    Example::

        >>> bn = syncbn.SyncBatchNorm1d(4)
        >>> replica = bn._replicate_for_data_parallel()   # calls attach_replica(bn, replica)
    """
    call = getattr(_local, "call", None)
    with _open_lock:
        current = _open.get(master)
        if call is not None:
            root, j, n = call
            joins = current is not None and j > 0 and current.declared == n and len(current._members) == j
        else:
            root, n = None, None
            joins = current is not None and current.being_made() and getattr(_local, "last", None) is current
        if current is None or current._rendezvous is not None or not joins:
            current = _open[master] = _Replication(master, n, root)
        index = current.add(replica)
        _local.last = current
    replica.__dict__["_syncbn_replica"] = _ReplicaSlot(current, index)
