"""Which group a call synchronizes over: :func:`resolve`, its cache, and pickling groups."""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from . import _mesh, _sum
from ._frame import SumGroup
from ._refs import ProcessGroupRef, group_ranks
from ._sum import ProcessGroupSum


def resolve(process_group: Any) -> SumGroup | None:
    """The group a training call synchronizes over, or ``None`` to run locally.

    Args:
        process_group: a ``torch.distributed`` process group, a :class:`ProcessGroupRef`, a ready
            :class:`SumGroup`, a ``DeviceMesh`` (its group; all its ranks when multi-dimensional),
            or ``None`` for the default group.

    Returns:
        ``None`` when ``torch.distributed`` is unavailable or not initialised, or the group has a
        single member: plain batch norm is then exact. Otherwise a :class:`SumGroup` (under an
        active ``syncbn.JoinableSyncBatchNorm``, the default group's is its Join wrapper).

    Raises:
        ValueError: before any state changes, ``process_group`` was destroyed
            (``destroy_process_group(group)``), on every rank that destroyed it; or it is
            ``GroupMember.NON_GROUP_MEMBER`` (``new_group`` left this rank out, where
            ``torch.nn.SyncBatchNorm`` silently runs unsynchronised), on that rank only.
    """
    # Concrete types first: a runtime Protocol check costs tens of microseconds, dist.ProcessGroup's a few.
    if type(process_group) in _sum_group_types:  # a ready SumGroup of a type seen before
        return process_group if process_group.size > 1 else None  # type: ignore[no-any-return]
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, ProcessGroupRef)):
        if _mesh.is_mesh(process_group):
            return resolve(_mesh.group_of(process_group)) if is_initialized() else None
        if isinstance(process_group, SumGroup):
            _sum_group_types.add(type(process_group))
            return process_group if process_group.size > 1 else None
    if not (dist.is_available() and dist.is_initialized()):
        if _resolved:
            forget_destroyed()
        return None
    if isinstance(process_group, ProcessGroupRef):
        process_group = process_group.lookup()
    live = dist.group.WORLD if process_group is None else process_group
    hit = _resolved.get(id(live))
    if hit is not None and hit[0]() is live:
        if live in dist.distributed_c10d._world.pg_map:  # a dict lookup: destroyed groups leave it
            return hit[1] if _sum._join is None else _sum.joined(hit[1])  # (a Join's wrapper)
        raise _destroyed(live)
    if isinstance(live, int):  # new_group's NON_GROUP_MEMBER (-100); a miss every call: it raises
        if live == dist.GroupMember.NON_GROUP_MEMBER:
            raise _not_a_member(live)
        raise TypeError(
            f"syncbn: expected process_group to be a torch.distributed process group or None (got {live!r})"
        )
    if live not in dist.distributed_c10d._world.pg_map:
        raise _destroyed(live)
    forget_destroyed()
    group = ProcessGroupSum(process_group) if dist.get_world_size(process_group) > 1 else None
    _resolved[id(live)] = (weakref.ref(live), group)
    return _sum.joined(group)


def _destroyed(process_group: Any) -> ValueError:
    """The error for a process group no longer registered: destroyed with ``destroy_process_group(g)``."""
    return ValueError(
        "syncbn: expected a live torch.distributed process group for this layer or call (got "
        f"{type(process_group).__name__} at {id(process_group):#x}, no longer registered: destroyed "
        "with torch.distributed.destroy_process_group(group)). Give the layer a live group (its "
        "process_group attribute, e.g. a new torch.distributed.new_group(...)) or process_group=None "
        "for the default group; nothing was changed"
    )


def _not_a_member(process_group: int) -> ValueError:
    """The error for ``NON_GROUP_MEMBER``: this rank, and the ranks of the group it was left out of."""
    rank = dist.get_rank()
    try:  # torch keeps the ranks of the last group that left this rank out under NON_GROUP_MEMBER
        last: str = f"global ranks {list(dist.get_process_group_ranks(process_group))}"  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - best effort in an error path
        last = "unknown"
    return ValueError(
        f"syncbn: expected a process group that global rank {rank} belongs to (got "
        f"torch.distributed.GroupMember.NON_GROUP_MEMBER ({process_group!r}), which "
        f"torch.distributed.new_group returns to the ranks it leaves out; the last group that left "
        f"rank {rank} out: {last}). Give each rank a group it is a member of (for example "
        "syncbn.groups.subgroup(k) or torch.distributed.new_subgroups(k)[0]), or process_group=None "
        "for the default group; nothing was changed"
    )


def forget_destroyed() -> None:
    """Drop (and close) the cached groups of destroyed process groups (:func:`resolve`, on a new
    group or once ``torch.distributed`` is no longer initialised)."""
    live = {id(g) for g in dist.distributed_c10d._world.pg_map} if is_initialized() else set()
    for key, (ref, group) in list(_resolved.items()):
        target = ref()
        if target is None or id(target) not in live:
            del _resolved[key]
            if group is not None:
                group.close()


_sum_group_types: set[type] = set()  # classes whose instances passed the SumGroup protocol check once
# Live process group's id -> (a weak reference to it, its ProcessGroupSum or None for a group of one).
_resolved: dict[int, tuple[weakref.ref[Any], ProcessGroupSum | None]] = {}


def to_picklable(process_group: Any) -> Any:
    """Replace a live process group by a :class:`ProcessGroupRef` for pickling."""
    if isinstance(process_group, dist.ProcessGroup):
        return ProcessGroupRef(group_ranks(process_group))
    return process_group


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialised."""
    return dist.is_available() and dist.is_initialized()
