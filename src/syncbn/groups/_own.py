"""Process groups of syncbn's own: made with syncbn's bound, destroyed with their parent and at exit.

Why a group of its own. Gloo gives up on a collective at its *group's* timeout: a bounded
``work.wait(timeout=...)`` returns to Python at syncbn's bound, but the ``all_reduce`` stays on
gloo's worker thread until the group's timeout (torch's default: 30 minutes), and
``destroy_process_group()``, ``~ProcessGroupGloo`` and so interpreter exit wait for it (measured on
torch 2.2.2 and 2.13: exit 30 s after a 2 s bound with a 30 s group timeout). So each
:class:`~syncbn.groups.ProcessGroupSum` runs its CPU collectives over a gloo group of its own, made
at its first CPU collective (a collective point every member reaches in the same order) with
syncbn's bound as the group's timeout: gloo itself then gives up at the bound, and recovery or
exit take seconds. Where torch can change a group's timeout (``_set_default_timeout``, torch 2.3
and later), a later :func:`syncbn.set_timeout` is carried over to the group. The group also keeps
syncbn's frames apart from DDP's and the user's collectives on the parent group.

Teardown (found with gdb on torch 2.2.2: the exit hang of issue 23). When Python drops a tensor
that a gloo work still holds, the tensor keeps its Python object alive, and gloo's worker thread,
when it releases the finished work, must take the GIL to free it. If at that moment the main
thread destroys the group (``~ProcessGroupGloo`` joins the worker threads, holding the GIL: a
``destroy_process_group()``, an ``atexit`` handler, interpreter finalisation), neither moves again.
So syncbn hands gloo only tensors that outlive the group: each group's frames are kept here
(:func:`keep`) with the group, and :func:`release` destroys a group in order: it waits (the GIL
released) for the works syncbn gave up on, destroys the group, drops the last reference to it
(its worker threads are joined then, with nothing left for them to free), and only then drops
its frames. syncbn holds these groups only here (a :class:`~syncbn.groups.ProcessGroupSum` holds
a weak reference and releases its group when it closes or is collected), and releases every one
still alive at exit (``atexit``, before finalisation). syncbn puts no Python callback on any
work or future.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["make", "adopt", "key_of", "keep", "owned", "set_timeout", "abandon", "release", "release_all"]

# key -> [a group syncbn made or adopted, the tensors handed to it, the pid that made it]; keys
# are serial numbers, never reused (an id() can recur once its object is gone).
_kept: dict[int, list[Any]] = {}
_keys: dict[int, int] = {}  # id(group) -> its key, while the group is held
_serial = itertools.count(1)
# Tensors handed to a group that is not syncbn's (a process group without gloo), and in a forked
# child the parent's groups: kept for good (never freed by a thread that must wait for another).
_forever: list[Any] = []
# Works given up on, with the tensor each holds, until they finish (see the module docstring).
_abandoned: list[tuple[Any, Tensor]] = []


def _gloo_backend(process_group: Any) -> Any:
    """The gloo backend of ``process_group`` for CPU tensors, or ``None``."""
    try:
        group = dist.group.WORLD if process_group is None else process_group
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no CPU backend, or an old torch
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def make(parent: Any, timeout_s: float) -> weakref.ref[Any] | None:
    """A gloo group over ``parent``'s ranks with ``timeout_s`` as its timeout (a weak reference), or ``None``.

    The group is held here (:func:`adopt`); :func:`release` with :func:`key_of` destroys it.

    Collective over the parent's members: each must call it at the same point (the
    group's first CPU collective). ``None`` where the parent has no gloo CPU backend (MPI,
    NCCL only): the parent then carries the CPU collectives, as before.

    Raises:
        RuntimeError: the members did not all arrive within ``timeout_s`` (torch's error).
    """
    if _gloo_backend(parent) is None:
        return None
    world = dist.get_world_size()
    ranks = list(range(world)) if parent is None else list(dist.get_process_group_ranks(parent))
    # All world ranks are members: a plain new_group (every rank calls it). A subgroup: only its
    # members call, hence local synchronisation.
    group = dist.new_group(
        ranks,
        timeout=timedelta(seconds=timeout_s),
        backend="gloo",
        use_local_synchronization=len(ranks) != world,
    )
    adopt(group)
    return weakref.ref(group)


def adopt(group: Any) -> int:
    """Hold ``group`` as one of syncbn's own, until :func:`release` (or exit); its key."""
    key = _key(group)
    if key is None:
        key = _keys[id(group)] = next(_serial)
        _kept[key] = [group, [], os.getpid()]
    return key


def _key(group: Any) -> int | None:
    key = _keys.get(id(group))
    entry = None if key is None else _kept.get(key)
    return key if entry is not None and entry[0] is group else None


def keep(group: Any, tensor: Tensor) -> None:
    """Keep ``tensor`` referenced for as long as ``group`` (it is handed to the group's collectives)."""
    key = None if group is None else _key(group)
    if key is not None:
        _kept[key][1].append(tensor)
    else:
        _forever.append(tensor)


def owned(group: Any) -> bool:
    """Whether ``group`` is one syncbn made (not the user's)."""
    return _key(group) is not None


def set_timeout(group: Any, timeout_s: float) -> bool:
    """Make ``timeout_s`` the timeout of ``group``'s gloo backend; ``False`` where torch cannot."""
    backend = _gloo_backend(group)
    setter = getattr(backend, "_set_default_timeout", None)
    if setter is None:
        return False
    try:
        setter(timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a backend that refuses
        return False
    return True


def abandon(work: Any, tensor: Tensor) -> None:
    """Keep ``work`` and its ``tensor`` referenced until the work has finished."""
    _prune()
    if work is not None:
        _abandoned.append((work, tensor))


def _prune() -> None:
    _abandoned[:] = [(w, t) for w, t in _abandoned if not _finished(w)]


def _finished(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot tell is treated as finished
        return True


def _wait_abandoned(limit_s: float) -> None:
    """Wait (the GIL released) for the abandoned works to end, at most ``limit_s`` in all."""
    deadline = time.monotonic() + limit_s
    for work, _ in list(_abandoned):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            if not _finished(work):
                work.wait(timeout=timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - it failed or timed out: it has ended or will not
            pass


def _registered(group: Any) -> bool:
    try:
        return group in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - torch.distributed being torn down
        return False


def key_of(group: Any) -> int:
    """The key :func:`release` takes for one of syncbn's groups (``adopt`` records it)."""
    return adopt(group)


def release(key: int, limit_s: float) -> None:
    """Destroy syncbn's group ``key`` in order: works, group, then its frames.

    Args:
        key: the group's key (:func:`key_of`).
        limit_s: the longest wait for its abandoned works (each ends at the group's timeout).
    """
    entry = _kept.pop(key, None)
    if entry is None:
        return
    group, frames, pid = entry
    del entry
    if _keys.get(id(group)) == key:
        del _keys[id(group)]
    if pid != os.getpid():
        _forever.extend([group, *frames])  # a forked child: the group and its threads are the parent's
        return
    if _abandoned:
        _wait_abandoned(limit_s)
    if _registered(group):
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already gone, or torch.distributed torn down
            pass
    del group  # the last reference: ~ProcessGroupGloo joins the worker threads here...
    _prune()
    del frames  # ...and only then are the tensors they held freed, on this thread


def release_all() -> None:
    """Release every group syncbn holds (at exit, before finalisation)."""
    for key, entry in list(_kept.items()):
        release(key, _limit(entry[0]))


def _limit(group: Any) -> float:
    backend = _gloo_backend(group)
    try:
        return float(backend.options._timeout.total_seconds()) + 1.0
    except Exception:  # noqa: BLE001 - unreadable options
        return 5.0


def _after_fork_in_child() -> None:
    for entry in _kept.values():
        entry[2] = -1  # the parent's: never destroyed (nor freed) here
    _forever.extend(_abandoned)
    _abandoned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(release_all)
