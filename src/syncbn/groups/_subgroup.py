"""Groups of ``k`` consecutive ranks or of one machine: :func:`subgroup` (docs/internals/groups.md)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .. import _shm
from . import _meet

__all__ = ["subgroup", "NODE"]

#: The ``size`` of :func:`subgroup` that asks for the ranks of this machine.
NODE = "node"

# key ("size", repr(k)) or ("node",) -> (weak reference to the default group it was made under, group).
_made: dict[tuple[str, ...], tuple[weakref.ref[Any], Any]] = {}


def _exchange(size: Any, world: int) -> list[list[int]]:
    """The member sets to create, in rank order, from every rank's request and machine (collective;
    raises on every rank alike)."""
    everyone = _meet.gather(f"syncbn.groups.subgroup({size!r})", "subgroup", [repr(size), _shm._host_key()])
    asked = [request for request, _ in everyone]
    if len(set(asked)) > 1:
        listed = ", ".join(f"rank {r}: {request}" for r, request in enumerate(asked))
        raise ValueError(
            f"syncbn.groups.subgroup: expected the same size on every rank (got {listed}); no group was made"
        )
    if size == NODE:
        return _shm.machines([float(key) for _, key in everyone])
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"syncbn.groups.subgroup: expected an int group size or {NODE!r} (got {size!r})")
    if size < 1 or world % size != 0:
        raise ValueError(
            f"syncbn.groups.subgroup: expected a group size that divides the world size {world} "
            f"(got group size {size})"
        )
    return [list(range(start, start + size)) for start in range(0, world, size)]


def subgroup(size: int | str) -> Any:
    """This rank's process group of ``size`` consecutive ranks, or of this machine's ranks.

    Every rank of the job must call it: the first time it is collective (the ranks compare their ``size`` in
    one exchange in the job's store, bounded by syncbn's bound, then each creates every group in the same
    order, so none hangs on a group another never makes). The result is cached per ``size`` for the life of
    the default group (later calls do not communicate) and destroyed with it.

    Use the result as ``process_group=`` of any syncbn layer (or of ``torch.distributed`` calls);
    :func:`syncbn.convert_sync_batchnorm` takes ``group_size=`` as the one-line form. A group whose
    ranks share one machine synchronises through shared memory like the default group.

    Args:
        size: ``k``, a group size that divides the world size (ranks ``[i*k, (i+1)*k)`` form
            group ``i``; ``k`` = world size is the default group, ``k = 1`` makes each rank its
            own group: plain BatchNorm), or ``"node"``: the ranks on this machine, as syncbn's
            shared memory sees machines (host name, boot id and PID namespace).

    Returns:
        This rank's ``torch.distributed.ProcessGroup``; the default group when it holds every rank.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: ``size`` does not divide the world size (the message names both), or the ranks asked for
            different sizes (named per rank); on every rank alike, before any group is made.
        TypeError: ``size`` is neither an int nor ``"node"`` (on every rank alike).
        syncbn.CollectiveError: (``timed_out=True``) a rank did not call it within syncbn's bound
            (``SYNCBN_TIMEOUT``); on every rank that called, naming the missing ranks; no group is made.

    Example::

        >>> group = syncbn.groups.subgroup(8)          # under torchrun, on every rank
        >>> bn = syncbn.SyncBatchNorm2d(64, process_group=group)
        >>> node = syncbn.groups.subgroup("node")      # the ranks of this machine
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"syncbn.groups.subgroup({size!r}) needs torch.distributed initialised "
            "(call torch.distributed.init_process_group first, on every rank)"
        )
    key = (NODE,) if size == NODE else ("size", repr(size))
    hit = cached(_made, key)
    if hit is not None:
        return hit
    sets = _exchange(size, dist.get_world_size())  # collective: every rank, the same sets or the same error
    return make_sets(_made, key, sets)


def cached(made: dict[Any, tuple[weakref.ref[Any], Any]], key: Any) -> Any:
    """The group ``made`` holds under ``key`` for the live default group, else ``None``."""
    default = dist.group.WORLD
    hit = made.get(key)
    live = dist.distributed_c10d._world.pg_map  # the registered groups: a destroyed one leaves it
    if hit is not None and hit[0]() is default and (hit[1] is default or hit[1] in live):
        return hit[1]
    for stale in [k for k, (ref, _) in made.items() if ref() is not default]:
        del made[stale]
    return None


def make_sets(made: dict[Any, tuple[weakref.ref[Any], Any]], key: Any, sets: Sequence[Sequence[int]]) -> Any:
    """This rank's group of the partition ``sets`` (every rank makes every group, in order)."""
    default = dist.group.WORLD
    mine: Any = default  # when the one set is every rank
    if len(sets) > 1:
        rank = dist.get_rank()
        for members in sets:
            group = dist.new_group(list(members))
            if rank in members:
                mine = group
    made[key] = (weakref.ref(default), mine)
    return mine


def group_for(process_group: Any, group_size: int | str | None, caller: str) -> Any:
    """``process_group``, or :func:`subgroup` of ``group_size`` (both given: ``ValueError``)."""
    if group_size is None:
        return process_group
    if process_group is not None:
        raise ValueError(
            f"{caller}: expected process_group or group_size, not both "
            f"(got process_group={process_group!r}, group_size={group_size!r})"
        )
    return subgroup(group_size)
