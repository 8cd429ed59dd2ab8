"""The hierarchical path for CPU groups that span several machines: machine sums, the leaders'
sum, the hand-back. See docs/internals/groups.md#hierarchical-reduction."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _config, _shm
from . import _own
from ._errors import _AFTER_FAILURE, CollectiveError
from ._frame import Tag
from ._refs import group_ranks

__all__ = ["DEFAULT", "Hierarchy", "choice", "connect"]

#: Whether a group spanning machines takes the hierarchical path when nothing says otherwise.
DEFAULT = True

# The status value a leader hands back after the machine sums (0: the total is good).
_OK, _TIMED_OUT, _FAILED, _MISMATCH = 0, 1, 2, 3
_WHAT = {
    _TIMED_OUT: "timed out waiting for the other machines",
    _FAILED: "failed: a rank on another machine died, or that machine is unreachable",
    _MISMATCH: "found that the machines made different collectives",
}
_CHECK_LOGS = "Check the other ranks' logs for the first error." + _AFTER_FAILURE


def choice(explicit: bool | None) -> bool:
    """This rank's choice: ``explicit``, else ``SYNCBN_HIERARCHICAL``, else :data:`DEFAULT`."""
    return _config._parse_switch("SYNCBN_HIERARCHICAL", DEFAULT) if explicit is None else explicit


class Hierarchy:
    """This rank's machine group (``local``; ``None`` alone on its machine) and, on a leader, the
    leaders' (``cross``); ``leader`` and ``size`` (for the errors) are of the whole group."""

    def __init__(self, local: Any, cross: Any, machines: int, leader: int, size: int) -> None:
        self.local = local
        self.cross = cross
        self.machines = machines
        self.leader = leader
        self.size = size
        # (dtype, numel) -> a vector of numel + 1 values: the payload and the status slot.
        self._buffers: dict[tuple[torch.dtype, int], Tensor] = {}

    def _buffer(self, tensor: Tensor) -> Tensor:
        key = (tensor.dtype, tensor.numel())
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) > 256:
                self._buffers.clear()
            buf = self._buffers[key] = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype)
        return buf

    def all_reduce_sum(self, tensor: Tensor, tag: Tag, host_wait: bool) -> Tensor:
        """Sum ``tensor`` in place over the whole group; the last two steps carry one value more: the
        number of failed machine sums, then the leader's verdict (``_OK``, ...)."""
        local, cross = self.local, self.cross
        n = tensor.numel()
        buf = self._buffer(tensor)
        if cross is None:  # a rank that does not lead its machine
            local._framed(tensor, tag, host_wait=host_wait, deferred=False)
            buf.zero_()
            local._framed(buf, tag, host_wait=host_wait, deferred=False)
            got = int(buf[n].item())
            if got != _OK:
                raise self._reported(got)
        else:
            failure: CollectiveError | None = None
            local_failed = False
            if local is not None:
                try:
                    local._framed(tensor, tag, host_wait=host_wait, deferred=False)
                except CollectiveError as exc:
                    failure, local_failed = exc, True  # it still makes the leaders' sum, reporting it
            buf[:n].copy_(tensor.reshape(-1))  # after the machine sum (a strided tensor's reshape copies)
            buf[n] = 0 if failure is None else 1
            status = _OK
            try:
                cross._framed(buf, tag, host_wait=host_wait, deferred=False)
            except CollectiveError as exc:
                status = _MISMATCH if exc.mismatch else (_TIMED_OUT if exc.timed_out else _FAILED)
                failure = failure or exc
            else:
                failed = int(buf[n].item())
                if failure is None and failed:
                    status = _FAILED
                    failure = self._failed(
                        f"{failed} other machine(s) reported a failed sum among their own ranks (a rank "
                        f"there died or timed out). {_CHECK_LOGS}"
                    )
            if local is not None and not local_failed:  # else its machine's ranks raised already
                buf[n] = status
                try:
                    local._framed(buf, tag, host_wait=host_wait, deferred=False)
                except CollectiveError as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
        tensor.copy_(buf[:n].view(tensor.shape))
        return tensor

    def _reported(self, status: int) -> CollectiveError:
        after = "No state was changed and the group is still usable." if status == _MISMATCH else _CHECK_LOGS
        return self._failed(
            f"this machine's leader (group rank {self.leader}) {_WHAT[status]}. {after}",
            timed_out=status == _TIMED_OUT,
            mismatch=status == _MISMATCH,
        )

    def _failed(self, what: str, *, timed_out: bool = False, mismatch: bool = False) -> CollectiveError:
        return CollectiveError(
            f"the sum across the machines of a hierarchical group of {self.size} ranks failed: {what}",
            timed_out=timed_out,
            waited=0.0,
            group_size=self.size,
            mismatch=mismatch,
        )

    def close(self) -> None:
        for group in (self.local, self.cross):
            if group is not None:
                group.close()


def connect(group: Any, wanted: bool, able: bool, exchange: Callable[[Tensor], Tensor]) -> Hierarchy | None:
    """Agree on the hierarchical path and split ``group`` (a ``ProcessGroupSum``) by machine, collectively
    (one ``exchange`` of every rank's choice, ability and machine); ``None`` on every rank where not
    taken, a ``mismatch`` :class:`CollectiveError` on every rank where the ranks chose differently."""
    rank, size, process_group = group.rank, group.size, group.process_group
    table = torch.zeros(size, 3, dtype=torch.float64)
    table[rank] = torch.tensor([float(wanted), float(able), _shm._host_key()], dtype=torch.float64)
    rows = exchange(table).tolist()
    wants = [bool(row[0]) for row in rows]
    if any(wants) and not all(wants):
        on = [r for r, w in enumerate(wants) if w]
        off = [r for r, w in enumerate(wants) if not w]
        raise CollectiveError(
            f"the ranks of a group of {size} ranks chose the hierarchical path differently: group ranks "
            f"{on} chose it and {off} did not (SYNCBN_HIERARCHICAL, or ProcessGroupSum(hierarchical=...)). "
            "Set SYNCBN_HIERARCHICAL alike on every rank (or on none). No state was changed.",
            timed_out=False,
            waited=0.0,
            group_size=size,
            mismatch=True,
        )
    if not all(wants) or not all(row[1] for row in rows):
        return None
    machines = _shm.machines([row[2] for row in rows])
    if len(machines) < 2 or all(len(members) == 1 for members in machines):
        return None
    mine = next(members for members in machines if rank in members)
    leaders = [members[0] for members in machines]
    # The subgroups' timeout is syncbn's bound, so gloo gives up an abandoned collective at it too.
    bound = _config.get_timeout()
    sets = [members for members in machines if len(members) > 1] + [leaders]
    wires = _own.make_sets(process_group, sets, _own.bound_s(process_group))
    if wires is None:
        subgroups = _subgroups(group_ranks(process_group), sets, bound)
    else:
        subgroups = {members: ref() for members, ref in wires.items()}
    make = type(group)
    local = None
    if len(mine) > 1:
        local = make(subgroups[tuple(mine)], own_group=True, shared_memory=True, hierarchical=False)
    cross = None
    if rank == mine[0]:
        cross = make(subgroups[tuple(leaders)], own_group=True, shared_memory=False, hierarchical=False)
    return Hierarchy(local, cross, len(machines), mine[0], size)


def _subgroups(ranks: list[int], sets: list[list[int]], bound: float | None) -> dict[tuple[int, ...], Any]:
    """torch's process groups of ``sets`` (``ranks``: their global ranks), where wires cannot be made."""
    extra: dict[str, Any] = {} if bound is None else {"timeout": timedelta(seconds=bound)}
    made: dict[tuple[int, ...], Any] = {}
    whole_job = len(ranks) == dist.get_world_size()
    for members in sets:
        members_global = [ranks[r] for r in members]
        if whole_job:
            made[tuple(members)] = dist.new_group(members_global, **extra)
        elif dist.get_rank() in members_global:
            made[tuple(members)] = dist.new_group(members_global, use_local_synchronization=True, **extra)
    return made
