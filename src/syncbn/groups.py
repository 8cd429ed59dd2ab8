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
An explicit process group cannot be pickled; :class:`ProcessGroupRef` stands in
for it inside a saved module and is looked up again, by its global ranks, on
first use after loading.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor

__all__ = ["SumGroup", "ProcessGroupSum", "ProcessGroupRef", "resolve", "group_ranks"]


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
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        return tensor

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
    if isinstance(process_group, SumGroup):
        return process_group if process_group.size > 1 else None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(process_group, ProcessGroupRef):
        process_group = process_group.lookup()
    if dist.get_world_size(process_group) <= 1:
        return None
    return ProcessGroupSum(process_group)


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
