"""Process groups of syncbn's own ("wires": bare gloo groups whose timeout is syncbn's bound), held
only here with the tensors handed to them, destroyed in order by :func:`release`. Why, and how the
members meet: docs/internals/groups.md#bounded-waits-and-syncbns-own-wires."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _config

__all__ = ["make", "make_sets", "wire_ranks", "adopt", "keep", "owned", "set_timeout", "abandon", "release"]

# key (a serial number: an id() can recur) -> [a group syncbn made or adopted, its tensors, its pid,
# the global ranks of a wire made here (make_sets) or None].
_kept: dict[int, list[Any]] = {}
_keys: dict[int, int] = {}  # id(group) -> its key, while the group is held
_serial = itertools.count(1)
# Tensors handed to a group that is not syncbn's, and in a forked child the parent's groups: kept for good.
_forever: list[Any] = []
# Works given up on, with the tensor each holds, until they finish.
_abandoned: list[tuple[Any, Tensor]] = []
process_id = os.getpid()  # set again in a forked child: what was made before the fork is the parent's


def _cpu_backend(process_group: Any) -> Any:
    """The CPU backend of ``process_group`` (``None``: the default group); raises if none."""
    group: Any = dist.group.WORLD if process_group is None else process_group
    if isinstance(group, dist.ProcessGroupGloo):  # a wire of syncbn's own (:func:`make`)
        return group
    return group._get_backend(torch.device("cpu"))


def _gloo_backend(process_group: Any) -> Any:
    """The gloo backend of ``process_group`` for CPU tensors, or ``None``."""
    try:
        backend = _cpu_backend(process_group)
    except Exception:  # noqa: BLE001 - no CPU backend, or an old torch
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def timeout_s(process_group: Any, unknown: float = 1800.0) -> float:
    """The process group's own timeout in seconds (its CPU backend's options), else ``unknown``."""
    try:
        return float(_cpu_backend(process_group).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - any backend without readable options
        return unknown


def bound_s(process_group: Any) -> float:
    """The wait bound: syncbn's, else ``process_group``'s own timeout."""
    bound = _config.get_timeout()
    return timeout_s(process_group) if bound is None else bound


# Parent group's name -> wires this process made over it (every member makes them at the same points).
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
    """A weak reference to a gloo wire over ``parent``'s members (collective), or ``None`` where the
    parent has no gloo CPU backend or torch's internals differ; raises when the members did not meet."""
    every = list(range(dist.get_world_size(parent)))
    made = None if _gloo_backend(parent) is None else make_sets(parent, [every], timeout_s)
    return None if made is None else made.get(tuple(every))


def make_sets(
    parent: Any, sets: list[list[int]], timeout_s: float
) -> dict[tuple[int, ...], weakref.ref[Any]] | None:
    """:func:`make` for the sets of ``parent``'s group ranks this rank belongs to (each set's members
    meet only each other): set -> a weak reference to its wire, or ``None``."""
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
        _kept[adopt(wire)][3] = [ranks[r] for r in members]
        made[tuple(members)] = weakref.ref(wire)
    return made


# Gloo waits up to five times a group's timeout for a pair's first connection (``waitUntil`` in
# gloo/transport/tcp/pair.h): a member lost before connecting would hold the others for 5x the bound.
_CONNECT_WAITS = 5


def _connect(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo group over ``store`` whose members all meet within ``timeout_s`` (presence in the store,
    then gloo's connection with a fifth of it), or an error."""
    here = [f"here/{r}" for r in range(size)]
    store.set(here[rank], "1")
    store.wait(here, _delta(timeout_s))
    connect_s = max(timeout_s / _CONNECT_WAITS, _config.MIN_TIMEOUT_S) if CARRIES_TIMEOUT else timeout_s
    wire = dist.ProcessGroupGloo(store, rank, size, _delta(connect_s))
    if connect_s != timeout_s and not set_timeout(wire, timeout_s):
        raise RuntimeError(
            f"syncbn could not set the timeout of its gloo group to {timeout_s:g} s after its "
            f"connection (made with {connect_s:g} s); torch {torch.__version__}"
        )
    return wire


def _delta(seconds: float) -> timedelta:
    """``seconds`` as a ``timedelta`` of at least 1 ms (c10d and gloo read 0 ms as "no timeout")."""
    return timedelta(seconds=max(seconds, _config.MIN_TIMEOUT_S))


def wire_ranks(group: Any) -> list[int] | None:
    """The global ranks of one of syncbn's wires, in its rank order (``None``: not a wire)."""
    key = _key(group)
    return None if key is None else _kept[key][3]


def adopt(group: Any) -> int:
    """Hold ``group`` as one of syncbn's own, until :func:`release` (or exit); its key."""
    key = _key(group)
    if key is None:
        key = _keys[id(group)] = next(_serial)
        _kept[key] = [group, [], os.getpid(), None]
    return key


def _key(group: Any) -> int | None:
    key = _keys.get(id(group))
    entry = None if key is None else _kept.get(key)
    return key if entry is not None and entry[0] is group else None


def keep(group: Any, tensor: Tensor) -> None:
    """Keep ``tensor`` referenced for as long as ``group`` (it is handed to the group's collectives)."""
    key = _key(group)
    (_forever if key is None else _kept[key][1]).append(tensor)


def owned(group: Any) -> bool:
    """Whether ``group`` is one syncbn made (not the user's)."""
    return _key(group) is not None


# Whether a changed timeout reaches gloo's waits: checked on torch 2.13 and 2.15. On 2.8 the setter
# exists but gloo keeps the old timeout (measured); 2.2 has none; releases in between: treated as 2.8.
CARRIES_TIMEOUT = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def set_timeout(group: Any, timeout_s: float) -> bool:
    """Make ``timeout_s`` the timeout of ``group``'s gloo backend; ``False`` where torch cannot."""
    setter = getattr(_gloo_backend(group), "_set_default_timeout", None) if CARRIES_TIMEOUT else None
    if setter is None:
        return False
    try:
        setter(_delta(timeout_s))
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
        with contextlib.suppress(Exception):  # it failed or timed out: it has ended or will not
            if not _finished(work):
                work.wait(timeout=_delta(left))


def release(key: int, limit_s: float) -> None:
    """Destroy group ``key`` (:func:`adopt`) in order: its works (``limit_s`` at most), group, tensors."""
    entry = _kept.pop(key, None)
    if entry is None:
        return
    group, frames, pid, _ = entry
    del entry
    if _keys.get(id(group)) == key:
        del _keys[id(group)]
    if pid != os.getpid():
        _forever.extend([group, *frames])  # a forked child: the group and its threads are the parent's
        return
    if _abandoned:
        _wait_abandoned(limit_s)
    with contextlib.suppress(Exception):  # already gone, or torch.distributed torn down
        if group in dist.distributed_c10d._world.pg_map:  # registered with torch (not a wire)
            dist.destroy_process_group(group)
    del group  # the last reference: ~ProcessGroupGloo joins the worker threads here...
    _prune()
    del frames  # ...and only then are the tensors they held freed, on this thread


def release_all() -> None:
    """Release every group syncbn holds (at exit, before finalisation)."""
    for key, entry in list(_kept.items()):
        release(key, timeout_s(entry[0], 4.0) + 1.0)


def _after_fork_in_child() -> None:
    global process_id
    process_id = os.getpid()  # (the groups in _kept are the parent's: release never destroys them here)
    _forever.extend(_abandoned)
    _abandoned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(release_all)
