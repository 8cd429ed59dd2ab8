"""Process groups of syncbn's own: made with syncbn's bound, destroyed with their parent and at exit.

Why a group of its own. Gloo gives up on a collective at its *group's* timeout: a bounded
``work.wait(timeout=...)`` returns to Python at syncbn's bound, but the ``all_reduce`` stays on
gloo's worker thread until the group's timeout (torch's default: 30 minutes), and
``destroy_process_group()``, ``~ProcessGroupGloo`` and so interpreter exit wait for it (measured on
torch 2.2.2 and 2.13: exit 30 s after a 2 s bound with a 30 s group timeout). So each
:class:`~syncbn.groups.ProcessGroupSum` without shared memory runs its CPU collectives over a
*wire* of its own (:func:`make`), made right after its set-up (a collective point every member
reaches in the same order, just shown alive) with syncbn's bound as its timeout: gloo itself then
gives up at the bound, and recovery or exit take seconds. Where gloo takes a changed timeout
(torch 2.13 and later, :data:`CARRIES_TIMEOUT`), a later :func:`syncbn.set_timeout` is carried
over to the wire. The wire also keeps syncbn's frames apart from DDP's and the user's collectives.

A wire is a bare ``dist.ProcessGroupGloo`` whose members meet in the job's store under
``syncbn/wire/<the parent group's name>/<generation>/<members>/``: the parent's name is the same
on every member, and the generation counts the wires this process made over that parent, which
every member makes at the same collective points. Nothing else takes part: unlike
``dist.new_group`` (a collective of the whole job, or, with local synchronisation, a name derived
from each rank's own count of groups, which differs between ranks of overlapping groups), a wire
never needs a rank outside its group. Wires are not registered with ``torch.distributed``.
Meeting takes two bounded steps (:func:`_connect`): a presence check in the store with the bound,
then gloo's connection with a fifth of it (gloo waits five times a group's timeout for a pair's
first connection), the timeout raised to the bound once connected.

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

__all__ = [
    "make",
    "make_sets",
    "wire_ranks",
    "adopt",
    "key_of",
    "keep",
    "owned",
    "set_timeout",
    "abandon",
    "release",
    "release_all",
]

# key -> [a group syncbn made or adopted, the tensors handed to it, the pid that made it]; keys
# are serial numbers, never reused (an id() can recur once its object is gone).
_kept: dict[int, list[Any]] = {}
_keys: dict[int, int] = {}  # id(group) -> its key, while the group is held
_serial = itertools.count(1)
_ranks: dict[int, list[int]] = {}  # key -> the global ranks of a wire made here (make_sets)
# Tensors handed to a group that is not syncbn's (a process group without gloo), and in a forked
# child the parent's groups: kept for good (never freed by a thread that must wait for another).
_forever: list[Any] = []
# Works given up on, with the tensor each holds, until they finish (see the module docstring).
_abandoned: list[tuple[Any, Tensor]] = []


def _gloo_backend(process_group: Any) -> Any:
    """The gloo backend of ``process_group`` for CPU tensors, or ``None``."""
    if isinstance(process_group, dist.ProcessGroupGloo):  # a wire of syncbn's own (:func:`make`)
        return process_group
    try:
        group = dist.group.WORLD if process_group is None else process_group
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no CPU backend, or an old torch
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


# Parent group's name -> how many wires this process made over it: the members of a group make
# its wires at the same collective points, in the same order, so they agree on this count.
_generations: dict[str, int] = {}


def _store_for(parent: Any) -> tuple[Any, str] | None:
    """The job's store and ``parent``'s name (the same on every member), or ``None``."""
    c10d = dist.distributed_c10d
    group: Any = dist.group.WORLD if parent is None else parent
    try:
        name = c10d._world.pg_names.get(group)
        store = c10d._world.pg_map[c10d._get_default_group()][1]
    except Exception:  # noqa: BLE001 - torch internals moved
        return None
    return None if name is None or store is None else (store, str(name))


def make(parent: Any, timeout_s: float) -> weakref.ref[Any] | None:
    """A gloo wire over ``parent``'s members, ``timeout_s`` its timeout (a weak reference), or ``None``.

    A bare ``dist.ProcessGroupGloo`` meeting in the job's store (see the module docstring),
    invisible to the user's group lookups, destroyed by :func:`release`. Collective over the
    parent's members: each must call it at the same point (right after the
    group's first collective, which showed every member present). ``None`` where the parent has
    no gloo CPU backend (MPI, NCCL only) or torch's internals differ: the parent then carries
    the CPU collectives.

    Raises:
        RuntimeError: the members did not all meet within ``timeout_s`` (gloo's error).
    """
    if _gloo_backend(parent) is None:
        return None
    size = dist.get_world_size(parent)
    made = make_sets(parent, [list(range(size))], timeout_s)
    return None if made is None else made.get(tuple(range(size)))


def make_sets(
    parent: Any, sets: list[list[int]], timeout_s: float
) -> dict[tuple[int, ...], weakref.ref[Any]] | None:
    """Wires over several sets of ``parent``'s members (group ranks), those this rank belongs to.

    As :func:`make` (every member of ``parent`` calls it at the same point, with the same
    ``sets``), but each set's members meet only each other. ``None`` where torch's internals
    differ (no store or group name to meet under).

    Returns:
        set (a tuple of group ranks) -> a weak reference to its wire, for the sets holding this rank.
    """
    found = _store_for(parent)
    if found is None:
        return None
    store, name = found
    generation = _generations[name] = _generations.get(name, 0) + 1
    me = dist.get_rank(parent)
    ranks = list(range(dist.get_world_size())) if parent is None else dist.get_process_group_ranks(parent)
    made: dict[tuple[int, ...], weakref.ref[Any]] = {}
    for members in sets:
        if me not in members:
            continue
        where = "-".join(map(str, members))
        prefixed = dist.PrefixStore(f"syncbn/wire/{name}/{generation}/{where}/", store)
        wire = _connect(prefixed, members.index(me), len(members), timeout_s)
        key = adopt(wire)
        _ranks[key] = [ranks[r] for r in members]
        made[tuple(members)] = weakref.ref(wire)
    return made


# Gloo waits up to five times a group's timeout for a pair's first connection (``waitUntil`` in
# gloo/transport/tcp/pair.h, since 2020): a member lost between publishing its address and
# connecting would hold the others in the constructor for 5x syncbn's bound (seen: 38 s and more
# with a 10 s bound).
_CONNECT_WAITS = 5


def _connect(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo group over ``store`` whose members all meet within ``timeout_s`` each way, or an error.

    Two bounded steps. First every member marks itself present and waits for the others
    (``store.wait`` with the bound: the store's own timeout, 30 minutes by default, never
    applies). Then gloo connects the pairs with a timeout of ``timeout_s / 5``, so that its
    initial-connect wait (five times the timeout) also ends at the bound; the group's timeout is
    then raised to ``timeout_s`` for its collectives. Where torch cannot change a gloo group's
    timeout (before 2.13, :data:`CARRIES_TIMEOUT`) the group is made with ``timeout_s``: a member
    lost in the milliseconds between the presence check and its connection is then found at up
    to five times the bound.
    """
    here = [f"here/{r}" for r in range(size)]
    store.set(here[rank], "1")
    store.wait(here, timedelta(seconds=timeout_s))
    connect_s = timeout_s / _CONNECT_WAITS if CARRIES_TIMEOUT else timeout_s
    wire = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=connect_s))
    if connect_s != timeout_s and not set_timeout(wire, timeout_s):
        raise RuntimeError(
            f"syncbn could not set the timeout of its gloo group to {timeout_s:g} s after its "
            f"connection (made with {connect_s:g} s); torch {torch.__version__}"
        )
    return wire


def wire_ranks(group: Any) -> list[int] | None:
    """The global ranks of one of syncbn's wires, in its rank order (``None``: not a wire)."""
    key = _key(group)
    return None if key is None else _ranks.get(key)


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


# Whether a changed timeout reaches gloo's waits: checked on torch 2.13 and 2.15. On 2.8 the setter
# (``ProcessGroupGloo._set_default_timeout``) exists but gloo keeps the timeout the group was made
# with (measured: a recv still timed out at the old 1.5 s after the bound went to 6 s); 2.2 has no
# setter. Releases between 2.8 and 2.13 were not checked: treated as not carrying (stated, warned).
CARRIES_TIMEOUT = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def set_timeout(group: Any, timeout_s: float) -> bool:
    """Make ``timeout_s`` the timeout of ``group``'s gloo backend; ``False`` where torch cannot."""
    if not CARRIES_TIMEOUT:
        return False
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
    _ranks.pop(key, None)
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
