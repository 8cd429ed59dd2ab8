"""A :class:`~syncbn.groups.SumGroup` whose members are threads of one process.

``nn.DataParallel`` runs one replica of the model per device, each in its own
thread. The replicas of one synchronized layer meet in a :class:`Rendezvous`:

* every member's ``i``-th call is matched with every other member's ``i``-th
  call (a *round*), so a layer used twice per forward pairs up correctly;
* a round completes when all members have arrived; the last one to arrive
  runs the round's ``combine`` function once, on the items in **member order**
  (never arrival order), and every member receives its result: the outcome is
  the same bits whatever the threads' timing;
* waits are bounded: a member that waits longer than ``timeout`` seconds raises
  :class:`ReplicaSyncError` naming the layer, the round and the members that
  never arrived, and marks the rendezvous broken so that its other waiting
  members fail at once instead of each waiting out its own timeout.

:class:`ThreadSumGroup` is one member's view of a rendezvous, with the
``all_reduce_sum`` of the :class:`~syncbn.groups.SumGroup` protocol: the sum is
taken in float64-or-input dtype on member 0's device, in member order, and
copied back into each member's tensor in place (as ``torch.distributed``'s
``all_reduce`` does).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["LOCAL", "LocalSum", "ReplicaSyncError", "Rendezvous", "ThreadSumGroup", "ordered_sum"]


class ReplicaSyncError(RuntimeError):
    """Raised when the replicas of a synchronized layer fail to meet.

    Typically one replica never reached the layer (a data-dependent branch, or
    an exception in that replica's thread) and the others gave up after the
    timeout; or the replicas called the layer in different ways.
    """


def ordered_sum(tensors: list[Tensor]) -> Tensor:
    """Elementwise sum of ``tensors`` in list order, on the first tensor's device.

    Args:
        tensors: at least one tensor, all of the same shape and dtype.

    Returns:
        A new tensor; the same inputs always give the same bits.
    """
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
    """Rounds of exchange among ``size`` threads, with a bounded wait.

    Args:
        size: number of members (threads).
        timeout: seconds a member waits for the others in one round.
        label: what the members synchronise, for error messages (a layer's
            name); a callable is evaluated only when an error is raised.

    Example::

        >>> rv = Rendezvous(2, timeout=5.0, label="demo")
        >>> # in thread k: rv.exchange(k, item, what="step") -> [item_0, item_1]
    """

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
        """The label, evaluated."""
        return self._label() if callable(self._label) else self._label

    def exchange(
        self,
        rank: int,
        item: Any,
        *,
        what: str,
        combine: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Contribute ``item`` to this member's next round and wait for the others.

        Args:
            rank: this member's index in ``[0, size)``.
            item: what this member contributes.
            what: the kind of round (e.g. ``"forward statistics"``); every
                member's ``i``-th round must be of the same kind.
            combine: run once, by the last member to arrive, on the items in
                member order; ``None`` returns the list of items.

        Returns:
            ``combine(items)`` (the same object for every member).

        Raises:
            ReplicaSyncError: a member did not arrive within the timeout, the
                members' rounds are of different kinds, or the rendezvous was
                already broken by such an error.
        """
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
                    self._cond.wait(remaining)
            rnd.taken += 1
            if rnd.taken == self.size:
                del self._rounds[index]
            if rnd.error is not None:
                raise ReplicaSyncError(
                    f"syncbn: {self.label}: combining the replicas' '{what}' failed: {rnd.error}"
                ) from rnd.error
            return rnd.result

    def _break(self, message: str) -> None:
        """Mark the rendezvous broken, wake every waiter, and raise in the caller."""
        self._broken = message
        self._cond.notify_all()
        raise ReplicaSyncError(message)


class ThreadSumGroup:
    """:class:`~syncbn.groups.SumGroup` over the threads of a :class:`Rendezvous`.

    Args:
        rendezvous: the shared rendezvous of all members.
        rank: this member's index in ``[0, rendezvous.size)``.

    Example::

        >>> rv = Rendezvous(2, timeout=5.0)
        >>> groups = [ThreadSumGroup(rv, k) for k in range(2)]
        >>> # thread k: groups[k].all_reduce_sum(t_k) -> t_0 + t_1 (in place)
    """

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        if not 0 <= rank < rendezvous.size:
            raise ValueError(f"expected a rank in [0, {rendezvous.size}) (got {rank})")
        self.rendezvous = rendezvous
        self._rank = rank

    @property
    def size(self) -> int:
        return self.rendezvous.size

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over all members in member order; write the result into it.

        Args:
            tensor: this member's contribution; same shape and dtype on every member.

        Returns:
            ``tensor``, now holding the sum.
        """
        total = self.rendezvous.exchange(self._rank, tensor, what="all_reduce_sum", combine=ordered_sum)
        with torch.no_grad():
            return tensor.copy_(total)

    def __repr__(self) -> str:
        return f"ThreadSumGroup(rank={self._rank}, size={self.size})"


class LocalSum:
    """The "none" reducer: a group of one, whose sum is the tensor itself.

    A family whose math differs from ``nn.BatchNorm`` (renorm) runs the engine
    through it when there is no group to synchronise over.
    """

    size = 1
    rank = 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


LOCAL = LocalSum()
