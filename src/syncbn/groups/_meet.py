"""Every rank of the job meets in the job's store within syncbn's bound, or every rank raises:
:func:`meet`. The protocol: docs/internals/groups.md#subgroups."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _own
from ._errors import CollectiveError, bound_source

__all__ = ["NO_GROUP", "gather", "meet", "new_group"]

_GO = "go"
#: What a failed meeting of a group's set-up leaves as it was.
NO_GROUP = "No group was made; the process group is still usable."


def meet(caller: str, tag: str, value: str = "", *, consequence: str = "") -> list[str] | None:
    """Every rank's ``value``, in rank order, once every rank of the job has called with ``tag``. ``caller``
    names the public call in the error, ``consequence`` is appended to it; ``tag`` is the same on every rank
    (never the value: ranks asking for different things must meet to raise alike). ``None`` where torch's
    internals hide the store. Raises ``CollectiveError(timed_out=True)`` on every rank that called when a rank
    did not arrive within the bound."""
    found = _own._store_for(None)
    if found is None:
        return None
    base, name = found
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.PrefixStore(f"syncbn/meet/{name}/{tag}/", base)
    epoch = store.compare_set("epoch", "", "0").decode()
    here = dist.PrefixStore(f"{epoch}/", store)
    keys = [f"value/{r}" for r in range(world)]
    bound, source = _own.bound_s(None), bound_source()
    start = time.monotonic()
    here.set(keys[rank], value)
    try:
        here.wait(keys, timedelta(seconds=bound))
        proposal = _GO
    except Exception:  # noqa: BLE001 - a store's timeout: RuntimeError or DistStoreError
        missing = [r for r in range(world) if not _present(here, keys[r])]
        proposal = "missing " + ",".join(map(str, missing)) if missing else _GO
    verdict = here.compare_set("verdict", "", proposal).decode()
    store.compare_set("epoch", epoch, str(int(epoch) + 1))  # the first to settle moves it on
    if verdict == _GO:
        got = here.multi_get(keys) if hasattr(here, "multi_get") else [here.get(k) for k in keys]
        return [v.decode() for v in got]
    missing = [int(r) for r in verdict.removeprefix("missing ").split(",")]
    waited = time.monotonic() - start
    if rank in missing:
        what = (
            f"rank {rank} arrived after the other ranks had given up waiting for it (bound: "
            f"{bound:g} s: {source}; the ranks missing then: {missing})"
        )
    else:
        what = (
            f"waited {waited:.1f} s (bound: {bound:g} s: {source}) for every rank of the default "
            f"group of {world} ranks to call it, and global ranks {missing} did not"
        )
    message = (
        f"{caller} is collective over every rank of the job: {what}. Call it on every rank "
        "at the same point of the program (not under a rank-dependent branch); a rank may also be "
        "busy elsewhere (raise the bound with SYNCBN_TIMEOUT=<seconds> or syncbn.set_timeout()) "
        f"or dead.{(' ' + consequence) if consequence else ''}"
    )
    raise CollectiveError(message, timed_out=True, waited=waited, group_size=world)


def gather(caller: str, tag: str, value: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order: :func:`meet`, else ``all_gather_object``."""
    met = meet(caller, tag, json.dumps(value), consequence=NO_GROUP)
    if met is not None:
        return [json.loads(text) for text in met]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _present(store: Any, key: str) -> bool:
    """Whether ``key`` is set, without waiting: ``Store.check`` (torch 2.2 lacks it: a 1 ms wait)."""
    if hasattr(store, "check"):
        return bool(store.check([key]))
    try:
        store.wait([key], timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001 - a store's timeout: RuntimeError or DistStoreError
        return False
    return True


def new_group(caller: str, ranks: list[int], timeout: timedelta | None) -> Any:
    """``torch.distributed.new_group(ranks, timeout=timeout)`` once every rank has arrived (:func:`meet`)."""
    meet(caller, "new_group", consequence=NO_GROUP)
    return dist.new_group(ranks, timeout=timeout)
