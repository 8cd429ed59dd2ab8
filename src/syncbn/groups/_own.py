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

Teardown. A tensor that Python dropped while a gloo work still holds it keeps its Python object
alive, and gloo's worker thread then needs the GIL to free it; a thread holding the GIL while it
destroys the group (``~ProcessGroupGloo`` joins the worker threads) would wait forever. So every
tensor handed to a collective that was abandoned (timed out or failed) stays referenced here,
with its work, until the work has finished, and at exit (``atexit``, before the interpreter
finalises anything) syncbn waits for those works with the GIL released (each ends at most the
group's timeout after it started) and destroys the groups it made, so none is left for
finalisation. syncbn puts no Python callback on any work or future.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["make", "adopt", "owned", "set_timeout", "abandon", "destroy", "destroy_all"]

# id -> (weak reference to a group syncbn made or adopted, the pid that made it).
_groups: dict[int, tuple[weakref.ref[Any], int]] = {}
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


def make(parent: Any, timeout_s: float) -> Any:
    """A gloo group over ``parent``'s ranks with ``timeout_s`` as its timeout, or ``None``.

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
    everyone = len(ranks) == world
    # All world ranks are members: a plain new_group (every rank calls it). A subgroup: only its
    # members call, hence local synchronisation.
    group = dist.new_group(
        ranks,
        timeout=timedelta(seconds=timeout_s),
        backend="gloo",
        use_local_synchronization=not everyone,
    )
    adopt(group)
    return group


def adopt(group: Any) -> None:
    """Count ``group`` among syncbn's own: destroyed at exit if still alive then."""
    _groups[id(group)] = (weakref.ref(group), os.getpid())


def owned(group: Any) -> bool:
    """Whether ``group`` is one syncbn made (not the user's)."""
    entry = _groups.get(id(group))
    return entry is not None and entry[0]() is group


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
    _abandoned[:] = [(w, t) for w, t in _abandoned if not _finished(w)]
    if work is not None:
        _abandoned.append((work, tensor))


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
    abandon(None, torch.empty(0))


def _registered(group: Any) -> bool:
    try:
        return group in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - torch.distributed being torn down
        return False


def destroy(group: Any, limit_s: float) -> None:
    """Destroy ``group`` if torch still knows it, after its abandoned works ended (at most ``limit_s``)."""
    entry = _groups.pop(id(group), None)
    if group is None or not _registered(group):
        return
    if entry is not None and entry[1] != os.getpid():
        return  # a forked child: the group (and its threads) belong to the parent
    _wait_abandoned(limit_s)
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone, or torch.distributed torn down
        pass


def destroy_all(limit_s: float | None = None) -> None:
    """Destroy every group syncbn made that is still alive (run at exit)."""
    for key, (ref, pid) in list(_groups.items()):
        group = ref()
        if group is None or pid != os.getpid():
            _groups.pop(key, None)
            continue
        destroy(group, _limit(group) if limit_s is None else limit_s)


def _limit(group: Any) -> float:
    backend = _gloo_backend(group)
    try:
        return float(backend.options._timeout.total_seconds()) + 1.0
    except Exception:  # noqa: BLE001 - unreadable options
        return 5.0


def _after_fork_in_child() -> None:
    _groups.clear()
    _abandoned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(destroy_all)
