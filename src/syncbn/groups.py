"""The communication seam: "sum these tensors across my group".

Synchronized batch norm needs exactly one operation from its transport: an
elementwise SUM of a small float64 vector over every member of a group, the
result landing on every member. Per layer and training step that happens twice:

1. forward: the packed moments ``[n, n*mean, m2 + n*mean^2]`` (``2C + 1`` values);
2. backward: ``[sum(dy), sum(dy * xhat)]`` (``2C`` values).

The size depends on the channel count only, never on the number of ranks.

A :class:`SumGroup` hides where the other members are:

* :class:`ProcessGroupSum` wraps a ``torch.distributed`` process group (any
  backend: gloo, NCCL, MPI) and runs ``all_reduce``;
* no group at all (single process, or a group of one) is represented by
  ``None`` from :func:`resolve`: callers then run plain batch norm.

``process_group=None`` on a layer means the default group, looked up at call
time, so a layer built before ``init_process_group`` works once it has run.
Every wait is bounded (:mod:`syncbn._config`: ``SYNCBN_TIMEOUT``,
:func:`syncbn.set_timeout`). :class:`ProcessGroupSum` starts the ``all_reduce``
asynchronously and waits on its work handle with that timeout (gloo honours it:
the wait raises after the bound, measured in torch 2.13). On a CPU tensor this
costs nothing extra: the caller needed the result anyway. On an accelerator a
bounded host wait would add a device-to-host synchronisation per call, so there
the wait is left to the device stream and the bound is the process group's own
timeout (``init_process_group(timeout=...)``, NCCL's watchdog), except in debug
mode and for the consistency checks, which wait on the host. Any failure of the
collective (timeout, a peer that closed its connection) becomes a
:class:`CollectiveError` that names the group; the autograd function adds the
layer's name. After such a failure the process group is unusable.

An explicit process group cannot be pickled; :class:`ProcessGroupRef` stands in
for it inside a saved module and is looked up again, by its global ranks, on
first use after loading.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor

from . import _config, _shm

__all__ = [
    "SumGroup",
    "ProcessGroupSum",
    "ProcessGroupRef",
    "CollectiveError",
    "resolve",
    "group_ranks",
]

_LIKELY_CAUSES = (
    "Likely causes: a rank skipped this layer or called the SyncBatchNorm layers in a different "
    "order (a data-dependent branch, an early `continue`); a rank is in eval mode or has "
    "freeze=True while the others train; a rank is still busy elsewhere (data loading, "
    "checkpointing, rank-0-only evaluation): raise the bound with SYNCBN_TIMEOUT=<seconds> or "
    "syncbn.set_timeout(); a rank died. Run every rank with SYNCBN_DEBUG=1 to check the layer "
    "order on every call."
)


class CollectiveError(RuntimeError):
    """A SyncBatchNorm collective timed out or failed; the process group is unusable.

    Args:
        message: the full explanation (layer, group, time waited, likely causes).
        timed_out: see below.
        waited: see below.
        group_size: see below.
        detail: the transport's own error text, if any.
        layer: see below.

    Attributes:
        timed_out: whether the bound on the wait was reached (else the transport
            failed, typically because a peer process died).
        waited: seconds this rank waited.
        group_size: number of ranks in the group.
        layer: the layer's name, or ``None`` before the layer is known.

    Example::

        >>> try:
        ...     loss = criterion(model(x), y)      # a peer skipped a SyncBatchNorm layer
        ... except syncbn.CollectiveError as exc:
        ...     print(exc.layer, exc.timed_out, f"{exc.waited:.0f} s")
        ...     torch.distributed.destroy_process_group()
        ...     raise
    """

    def __init__(
        self,
        message: str,
        *,
        timed_out: bool,
        waited: float,
        group_size: int,
        detail: str = "",
        layer: str | None = None,
    ) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.waited = waited
        self.group_size = group_size
        self.detail = detail
        self.layer = layer

    def for_layer(self, layer: str, phase: str) -> CollectiveError:
        """The same error, its message starting with the layer and the phase."""
        new = CollectiveError(
            f"syncbn: layer {layer} ({phase}): {self.args[0]}",
            timed_out=self.timed_out,
            waited=self.waited,
            group_size=self.group_size,
            detail=self.detail,
            layer=layer,
        )
        new.__cause__ = self.__cause__
        return new


@runtime_checkable
class SumGroup(Protocol):
    """A set of peers that can sum a tensor elementwise among themselves."""

    @property
    def size(self) -> int:
        """Number of members."""
        ...

    @property
    def rank(self) -> int:
        """This member's index in ``[0, size)``."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over all members; every member receives the result."""
        ...


class ProcessGroupSum:
    """:class:`SumGroup` over a ``torch.distributed`` process group.

    Args:
        process_group: the group, or ``None`` for the default (world) group.
        shared_memory: ``False`` keeps CPU collectives on the process group's
            transport even where every rank is on one machine; ``None`` follows
            :func:`syncbn.set_shared_memory` / ``SYNCBN_SHM`` (on by default).
            Either way the ranks agree collectively at the first CPU collective.
    """

    def __init__(self, process_group: Any = None, *, shared_memory: bool | None = None) -> None:
        self.process_group = process_group
        self._shared_memory_choice = shared_memory
        self._size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        # The live group, for "already verified" bookkeeping: a re-initialised
        # default group is a new object.
        self.key: Any = dist.group.WORLD if process_group is None else process_group
        # Same-machine shared-memory path for CPU tensors: connected on the first CPU collective.
        self._shared: _shm.SharedMemorySum | None = None
        self._shared_ready = False

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the group, waiting at most :func:`syncbn.get_timeout`.

        Args:
            tensor: the values to sum; overwritten with the sum.

        Returns:
            ``tensor``, now holding the sum.

        Raises:
            CollectiveError: the wait exceeded the bound, or the transport failed
                (a peer died). The process group cannot be used afterwards.
        """
        return self.all_reduce_sum_bounded(tensor, host_wait=False)

    def all_reduce_sum_bounded(self, tensor: Tensor, *, host_wait: bool) -> Tensor:
        """:meth:`all_reduce_sum`, optionally bounding the wait on the host for any device.

        The consistency checks use this with ``host_wait=True``: they read the
        result on the host anyway.

        Args:
            tensor: the values to sum; overwritten with the sum.
            host_wait: bound the wait on the host even for an accelerator tensor
                (a device-to-host synchronisation; always done for CPU tensors
                and in debug mode).

        Returns:
            ``tensor``, now holding the sum.
        """
        if tensor.device.type == "cpu":
            shared = self._shared if self._shared_ready else self._connect_shared()
            if shared is not None and shared.fits(tensor):
                try:
                    return shared.all_reduce_sum(tensor, _config.get_timeout())
                except _shm.SharedMemoryError as exc:
                    if exc.mismatch:
                        raise self._mismatch(exc) from exc
                    cause = None if exc.timed_out else exc
                    raise self._error(cause, exc.waited, _config.get_timeout()) from exc
        return self._all_reduce_process_group(tensor, host_wait=host_wait)

    def _connect_shared(self) -> _shm.SharedMemorySum | None:
        """Set up the shared-memory path (collective: every rank's first CPU collective on this group)."""
        choice = self._shared_memory_choice
        self._shared = _shm.connect(
            self._rank,
            self._size,
            _config.shared_memory_enabled() if choice is None else choice,
            lambda t: self._all_reduce_process_group(t, host_wait=True),
        )
        self._shared_ready = True
        return self._shared

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this group's CPU collectives go through shared memory (known after its first one)."""
        return self._shared is not None

    def _all_reduce_process_group(self, tensor: Tensor, *, host_wait: bool) -> Tensor:
        delta = _config.timeout_delta()
        if delta is None or not (host_wait or tensor.device.type == "cpu" or _config.debug_enabled()):
            start = time.monotonic()
            try:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                raise self._error(exc, time.monotonic() - start, None) from exc
            return tensor
        start = time.monotonic()
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            finished = work.wait(timeout=delta)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(exc, time.monotonic() - start, _config.get_timeout()) from exc
        if finished is False:  # some backends report a timeout by returning False
            raise self._error(None, time.monotonic() - start, _config.get_timeout())
        return tensor

    def describe(self) -> str:
        """The group in words: size, global ranks (when known) and this member's rank."""
        try:
            ranks: Any = group_ranks(self.process_group)
            if len(ranks) > 16:
                ranks = f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
        except Exception:  # noqa: BLE001 - best effort in an error path
            ranks = "unknown"
        which = "the default group" if self.process_group is None else "process group"
        via = ", through shared memory" if self._shared is not None else ""
        return f"{which} of {self._size} ranks (global ranks {ranks}; this is group rank {self._rank}{via})"

    def _error(self, exc: BaseException | None, waited: float, timeout: float | None) -> CollectiveError:
        text = "" if exc is None else f"{type(exc).__name__}: {exc}".strip()
        timed_out = exc is None or "timed out" in text.lower() or "timeout" in text.lower()
        if timeout is not None and waited >= 0.95 * timeout:
            timed_out = True
        if timed_out:
            bound = "" if timeout is None else f" (bound: SYNCBN_TIMEOUT/syncbn.set_timeout = {timeout:g} s)"
            head = (
                f"waited {waited:.1f} s{bound} for the all_reduce over {self.describe()}, "
                "and not every rank arrived. "
            )
            causes = _LIKELY_CAUSES
        else:
            head = (
                f"the all_reduce over {self.describe()} failed after {waited:.1f} s: "
                "a peer process most likely died or closed its connection. "
            )
            causes = "Check the other ranks' logs for the first error."
        message = (
            f"{head}{causes} The process group is unusable after this error: end the job or "
            "call torch.distributed.destroy_process_group()."
        )
        if text:
            message += f" [{text.splitlines()[0][:300]}]"
        return CollectiveError(
            message, timed_out=timed_out, waited=waited, group_size=self._size, detail=text
        )

    def _mismatch(self, exc: BaseException) -> CollectiveError:
        message = (
            f"the ranks of {self.describe()} did not make the same collective: {exc}. Every rank must "
            "call the SyncBatchNorm layers in training in the same order; run every rank with "
            "SYNCBN_DEBUG=1 to find the first layer where they differ."
        )
        return CollectiveError(message, timed_out=False, waited=0.0, group_size=self._size, detail=str(exc))

    def __repr__(self) -> str:
        return f"ProcessGroupSum(rank={self._rank}, size={self._size})"


def group_ranks(process_group: Any) -> list[int]:
    """Global ranks of the members of ``process_group`` (``None``: the default group)."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(process_group))


class ProcessGroupRef:
    """A picklable stand-in for a process group, naming it by its global ranks.

    Modules store one in place of an explicit process group when they are
    pickled (``torch.save``); :func:`resolve` finds the live group with the same
    ranks again when the loaded module first synchronizes.

    Args:
        ranks: the global ranks of the group's members, in group-rank order.
    """

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)

    def lookup(self) -> Any:
        """The live process group with these ranks.

        Raises:
            RuntimeError: when no such group exists in this job.
        """
        if self.ranks == list(range(dist.get_world_size())):
            return None
        world = dist.distributed_c10d._world
        for group, mapping in world.pg_group_ranks.items():
            ordered = sorted(mapping, key=mapping.__getitem__)
            if ordered == self.ranks:
                return group
        raise RuntimeError(
            f"syncbn: this module was saved with a process group of global ranks {self.ranks}, "
            "and no such group exists in this job; create it with torch.distributed.new_group "
            "and assign it to module.process_group"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessGroupRef) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessGroupRef(ranks={self.ranks})"


def resolve(process_group: Any) -> SumGroup | None:
    """The group a training call synchronizes over, or ``None`` to run locally.

    Args:
        process_group: a ``torch.distributed`` process group, a
            :class:`ProcessGroupRef`, a ready :class:`SumGroup`, or ``None`` for
            the default group.

    Returns:
        ``None`` when ``torch.distributed`` is unavailable or not initialised,
        or the group has a single member: plain batch norm is then exact.
        Otherwise a :class:`SumGroup`.
    """
    # Concrete types first: a runtime Protocol check costs tens of microseconds.
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, ProcessGroupRef)):
        if type(process_group) in _sum_group_types or isinstance(process_group, SumGroup):
            _sum_group_types.add(type(process_group))
            return process_group if process_group.size > 1 else None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(process_group, ProcessGroupRef):
        process_group = process_group.lookup()
    live = dist.group.WORLD if process_group is None else process_group
    hit = _resolved.get(id(live))
    if hit is not None and hit[0] is live:
        return hit[1]
    group = ProcessGroupSum(process_group) if dist.get_world_size(process_group) > 1 else None
    _resolved[id(live)] = (live, group)  # holds ``live``: its id cannot be reused
    return group


# Classes whose instances passed the SumGroup protocol check once.
_sum_group_types: set[type] = set()

# Live process group's id -> (the group, its ProcessGroupSum or None for a group of one).
_resolved: dict[int, tuple[Any, ProcessGroupSum | None]] = {}


def to_picklable(process_group: Any) -> Any:
    """Replace a live process group by a :class:`ProcessGroupRef` for pickling."""
    if process_group is None or isinstance(process_group, ProcessGroupRef):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return ProcessGroupRef(group_ranks(process_group))
    return process_group


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialised."""
    return dist.is_available() and dist.is_initialized()
