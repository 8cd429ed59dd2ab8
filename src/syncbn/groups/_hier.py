"""The hierarchical path of :mod:`syncbn.groups`, for CPU groups that span several machines.

Opt-in (``ProcessGroupSum(..., hierarchical=True)``, or ``SYNCBN_HIERARCHICAL=1`` on every
rank alike). At the group's first CPU collective, when the ranks are not all on one machine but
some machine holds two or more of them, every rank learns every rank's machine (the host key
of :mod:`syncbn._shm`) and the group splits, collectively and for good, into:

* one *machine group* per machine with two or more ranks: a ``ProcessGroupSum`` over a
  subgroup of that machine's ranks, whose CPU collectives take its shared memory;
* a *leaders' group*: a ``ProcessGroupSum`` over the lowest rank of every machine, on the
  process group's own transport (shared memory off: the leaders are on different machines).

A call then takes three steps, each framed and header-checked among its members:

1. the ranks of each machine sum through their shared memory (machine sum);
2. each leader sums the machine sums with the other leaders over the network;
3. each leader hands the total back through a second shared-memory round, in which it
   contributes the total and every other rank zeros: ``x + 0 == x``, so every rank of every
   machine receives the leaders' bits (the leaders' all_reduce gives every leader the same bits).

The network carries one vector per machine instead of one per rank. A leader whose step 2
fails (a mismatch among leaders, a timeout, a dead peer) still makes step 3, under a phase
that cannot match its machine's ranks' (:data:`PHASE_ABORT`): they raise at once instead of
waiting out the bound, and the leader raises its own error. ``shadow_sum`` (DDP ``Join``) is not
available on a hierarchical group.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ._errors import CollectiveError
from ._frame import Tag
from ._refs import group_ranks

__all__ = ["Hierarchy", "PHASE_ABORT", "connect"]

#: The phase a leader's hand-back round carries when its cross-machine sum failed.
PHASE_ABORT = 15


class Hierarchy:
    """This rank's part of a hierarchical group: its machine group and, on a leader, the leaders'.

    Args:
        local: the machine group (``None`` when this rank is alone on its machine).
        cross: the leaders' group (``None`` unless this rank leads its machine).
        machines: number of machines.
        leader: this machine's leader, as a rank of the whole group.
    """

    def __init__(self, local: Any, cross: Any, machines: int, leader: int) -> None:
        self.local = local
        self.cross = cross
        self.machines = machines
        self.leader = leader

    def all_reduce_sum(self, tensor: Tensor, tag: Tag, host_wait: bool) -> Tensor:
        """Sum ``tensor`` in place over the whole group: machine sum, leaders' sum, hand-back."""
        local, cross = self.local, self.cross
        failure: CollectiveError | None = None
        local_failed = False
        if local is not None:
            try:
                local._framed(tensor, tag, present=True, host_wait=host_wait, deferred=False)
            except CollectiveError as exc:
                if cross is None:
                    raise
                # A leader still takes part in the leaders' sum, under a phase that cannot match:
                # the other machines then raise at once instead of waiting out the bound.
                failure, local_failed = exc, True
        if cross is not None:
            cross_tag = tag if failure is None else Tag(tag.layer, PHASE_ABORT)
            try:
                cross._framed(tensor, cross_tag, present=True, host_wait=host_wait, deferred=False)
            except CollectiveError as exc:
                if failure is None:
                    failure = exc
        if local is not None and not local_failed:
            if cross is not None:
                back, back_tag = tensor, tag if failure is None else Tag(tag.layer, PHASE_ABORT)
            else:
                back, back_tag = torch.zeros_like(tensor), tag
            try:
                local._framed(back, back_tag, present=True, host_wait=host_wait, deferred=False)
            except CollectiveError as exc:
                if failure is None:
                    raise CollectiveError(
                        "the hand-back round of a hierarchical group failed: this machine's leader "
                        f"(group rank {self.leader}) reported a failed cross-machine sum, or this "
                        f"machine's ranks made different calls. {exc.args[0]}",
                        timed_out=exc.timed_out,
                        waited=exc.waited,
                        group_size=exc.group_size,
                        detail=exc.detail,
                        mismatch=exc.mismatch,
                    ) from exc
            if back is not tensor:
                tensor.copy_(back)
        if failure is not None:
            raise failure
        return tensor

    def close(self) -> None:
        for group in (self.local, self.cross):
            if group is not None:
                group.close()


def connect(
    rank: int,
    size: int,
    process_group: Any,
    host_key: float,
    exchange: Callable[[Tensor], Tensor],
    make_group: Callable[..., Any],
) -> Hierarchy | None:
    """Split the group by machine, collectively; ``None`` where a hierarchy gains nothing.

    Every rank of the group must call this at the same point. One ``exchange``
    (a summing all_reduce over the whole group) tells every rank every rank's
    machine; the subgroups are then made by their own members only
    (``new_group(use_local_synchronization=True)``).

    Args:
        rank: this rank's index in the group.
        size: number of ranks.
        process_group: the group's process group (``None``: the default group).
        host_key: this rank's machine (:func:`syncbn._shm._host_key`).
        exchange: sums a float64 tensor over the whole group, in place.
        make_group: builds a ``ProcessGroupSum`` (passed in: no import cycle).

    Returns:
        This rank's :class:`Hierarchy`, or ``None`` on every rank (one machine,
        or one rank per machine).
    """
    table = torch.zeros(size, dtype=torch.float64)
    table[rank] = host_key
    keys = exchange(table).tolist()
    machines: dict[float, list[int]] = {}
    for r, key in enumerate(keys):
        machines.setdefault(key, []).append(r)
    if len(machines) < 2 or all(len(members) == 1 for members in machines.values()):
        return None
    ranks = group_ranks(process_group)
    mine = machines[keys[rank]]
    leaders = [members[0] for members in machines.values()]
    local = None
    if len(mine) > 1:
        pg = dist.new_group([ranks[r] for r in mine], use_local_synchronization=True)
        local = make_group(pg, shared_memory=True, hierarchical=False)
    cross = None
    if rank == mine[0]:
        pg = dist.new_group([ranks[r] for r in leaders], use_local_synchronization=True)
        cross = make_group(pg, shared_memory=False, hierarchical=False)
    return Hierarchy(local, cross, len(machines), mine[0])
