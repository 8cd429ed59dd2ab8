"""In-process groups: ``nn.DataParallel`` replicas' threads meeting in a :class:`Rendezvous`, and ``LOCAL``.
See docs/internals/transports.md#the-rendezvous."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor

_WAIT_SLICE_S = 3600.0  # a wait longer than this (even an inf timeout) waits in slices

__all__ = ["LOCAL", "LocalSum", "ReplicaSyncError", "Rendezvous", "ThreadSumGroup", "ordered_sum"]


class ReplicaSyncError(RuntimeError):
    """Raised when the replicas of a synchronized layer fail to meet.

    Typically one replica never reached the layer (a data-dependent branch, or an exception in that replica's
    thread) and the others gave up after the timeout; or the replicas called the layer in different ways.
    """


def ordered_sum(tensors: list[Tensor]) -> Tensor:
    """Elementwise sum of ``tensors`` (at least one) in list order, as a new tensor on the first's device."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t.to(total.device, non_blocking=False)
    return total


class _Round:
    __slots__ = ("what", "items", "arrived", "done", "result", "error", "taken")

    def __init__(self, size: int, what: str) -> None:
        self.what = what
        self.items: list[Any] = [None] * size
        self.arrived = [False] * size
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.taken = 0


class Rendezvous:
    """Rounds of exchange among ``size`` threads, each waiting at most ``timeout`` seconds (``label``,
    or a callable evaluated only then, names what they synchronise in errors)."""

    def __init__(self, size: int, timeout: float, label: str | Callable[[], str] = "") -> None:
        if size < 1:
            raise ValueError(f"expected a rendezvous of at least 1 member (got size={size})")
        if not timeout > 0:
            raise ValueError(f"expected a positive timeout in seconds (got {timeout!r})")
        self.size = size
        self.timeout = float(timeout)
        self._label = label
        self._cond = threading.Condition()
        self._calls = [0] * size
        self._rounds: dict[int, _Round] = {}
        self._broken: str | None = None

    @property
    def label(self) -> str:
        return self._label() if callable(self._label) else self._label

    def exchange(
        self, rank: int, item: Any, *, what: str, combine: Callable[[list[Any]], Any] | None = None
    ) -> Any:
        """Contribute ``item`` to this member's next round, of kind ``what`` on every member; return
        ``combine(items)`` (``None``: the list), run once, by the last to arrive, in member order."""
        if not 0 <= rank < self.size:
            raise ValueError(f"expected a rank in [0, {self.size}) (got {rank})")
        with self._cond:
            if self._broken is not None:
                raise ReplicaSyncError(self._broken)
            index = self._calls[rank]
            self._calls[rank] += 1
            rnd = self._rounds.get(index)
            if rnd is None:
                rnd = self._rounds[index] = _Round(self.size, what)
            if rnd.what != what:
                self._break(
                    f"syncbn: replicas called {self.label} in different ways: replica {rank}'s "
                    f"call {index} is '{what}' while another replica's is '{rnd.what}'"
                )
            rnd.items[rank] = item
            rnd.arrived[rank] = True
            if all(rnd.arrived):
                try:
                    rnd.result = rnd.items if combine is None else combine(rnd.items)
                except BaseException as exc:  # re-raised in every member
                    rnd.error = exc
                rnd.items = []
                rnd.done = True
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self.timeout
                while not rnd.done:
                    if self._broken is not None:
                        raise ReplicaSyncError(self._broken)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = [r for r, ok in enumerate(rnd.arrived) if not ok]
                        self._break(
                            f"syncbn: {self.label}: replica {rank} of {self.size} waited "
                            f"{self.timeout:g} s in call {index} ('{what}') for replica(s) {missing}, "
                            "which never reached this layer. Every replica must run the layer the "
                            "same number of times per forward; one that takes another branch or "
                            "raises an exception before the layer leaves the others waiting"
                        )
                    self._cond.wait(min(remaining, _WAIT_SLICE_S))  # never beyond what wait() accepts
            rnd.taken += 1
            if rnd.taken == self.size:
                del self._rounds[index]
            if rnd.error is not None:
                raise ReplicaSyncError(
                    f"syncbn: {self.label}: combining the replicas' '{what}' failed: {rnd.error}"
                ) from rnd.error
            return rnd.result

    def abandon(self, message: str) -> None:
        """Mark the rendezvous broken (a member will never come) and wake every waiter, who raise."""
        with self._cond:
            if self._broken is None:
                self._broken = message
            self._cond.notify_all()

    def _break(self, message: str) -> None:
        """Mark the rendezvous broken, wake every waiter, and raise in the caller."""
        self._broken = message
        self._cond.notify_all()
        raise ReplicaSyncError(message)


class ThreadSumGroup:
    """:class:`~syncbn.groups.SumGroup` of member ``rank`` over the threads of a :class:`Rendezvous`."""

    replicas = True  # the SumGroup capability: one process's nn.DataParallel replicas

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self.rendezvous = rendezvous
        self.rank = rank

    @property
    def size(self) -> int:
        return self.rendezvous.size

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` (same shape and dtype on every member) in member order, in place."""
        total = self.rendezvous.exchange(self.rank, tensor, what="all_reduce_sum", combine=ordered_sum)
        with torch.no_grad():
            return tensor.copy_(total)

    def __repr__(self) -> str:
        return f"ThreadSumGroup(rank={self.rank}, size={self.size})"


class LocalSum:
    """A group of one, for families (renorm) that run the engine with no group."""

    size = 1
    rank = 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


LOCAL = LocalSum()
