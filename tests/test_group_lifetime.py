"""Groups are released with their process group (issue 27, item 3), on real gloo ranks.

The compiled path names a group by an integer handle (:func:`syncbn.engine._ops.group_handle`); the
handle table holds its groups weakly, so ``destroy_process_group()`` + ``init_process_group()``
cycles (elastic restarts in one process, notebooks, test suites) and subgroups made and destroyed
leave nothing behind: open file descriptors and mapped shared-memory segments come back to what
they were before syncbn was first used, and a compiled graph still holding a released group's
handle gets a clear error instead of using it.
"""

from __future__ import annotations

import gc
import os
import re
import tempfile
import weakref
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import syncbn
from _helpers.dist_harness import launch
from syncbn import _shm, groups

try:
    from syncbn.engine import _ops
except ImportError:  # syncbn.engine._ops raises ImportError (not ModuleNotFoundError) on torch without them
    _ops = None  # type: ignore[assignment]
needs_ops = pytest.mark.skipif(
    _ops is None, reason="no ordered effectful custom operators in this torch (syncbn.engine._ops)"
)

_SEGMENT = re.compile(r"syncbn-\d+-[0-9a-f]{12}")
CYCLES = 3


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _links() -> list[str]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:
            pass
    return sorted(out)


def _mapped() -> int:
    with open("/proc/self/maps") as f:
        return sum(_SEGMENT.search(line) is not None for line in f)


def _use(process_group: Any) -> None:
    """One collective through the compiled path's operator (called eagerly: no compile needed)."""
    handle = _ops.group_handle(process_group)
    assert handle
    t = torch.ones(3, dtype=torch.float64)
    out = _ops._all_reduce_op(t, handle, None, groups.PHASE_OTHER, None, 0)
    assert torch.equal(out, torch.full((3,), 2.0, dtype=torch.float64))


def _cycles(rank: int, world_size: int, tmp: str, shared: bool) -> dict[str, Any]:
    syncbn.set_shared_memory(shared)
    dist.barrier()  # every rank is connected before one destroys its side (a peer may still connect)
    dist.destroy_process_group()  # the harness's group: start from a clean slate
    # The baseline: one cycle of torch's own (gloo keeps 5 descriptors after its first groups).
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "b"), 2), rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))
    dist.destroy_process_group()
    gc.collect()
    base_fds, base_maps = _fds(), _mapped()
    base_links = _links()
    fds, maps, handles, stale = [], [], [], None
    alive: list[int] = []
    owned: list[int] = []
    for cycle in range(CYCLES):
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(tmp, f"c{cycle}"), 2),
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=30),
        )
        sub = dist.new_group([0, 1])
        _use(None)
        _use(sub)
        handle = _ops.group_handle(None)
        made = [weakref.ref(groups.resolve(None)), weakref.ref(groups.resolve(sub))]
        if cycle == CYCLES - 1:
            stale = handle
        dist.destroy_process_group()
        del sub
        groups.forget_destroyed()  # what the next resolve does by itself
        gc.collect()
        fds.append(_fds())
        maps.append(_mapped())
        handles.append(len(_ops._groups))
        alive.append(sum(ref() is not None for ref in made))
        owned.append(len(groups._own._kept))
    try:  # a compiled graph traced before the last destroy still holds this handle
        _ops._all_reduce_op(torch.ones(3), stale, None, groups.PHASE_OTHER, None, 0)
        stale_error = None
    except syncbn.CollectiveError as exc:
        stale_error = str(exc)
    dist.init_process_group(  # the harness leaves through its own store
        "gloo",
        store=dist.FileStore(os.path.join(tmp, "last"), 2),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    return {
        "base": (base_fds, base_maps),
        "fds": fds,
        "maps": maps,
        "handles": handles,
        "stale": stale_error,
        "alive": alive,
        "owned": owned,
        "links": _links(),
        "base_links": base_links,
    }


@pytest.mark.parametrize(
    "shared",
    [
        pytest.param(True, marks=pytest.mark.skipif(not _shm.supported(), reason="x86-64 Linux only")),
        False,
    ],
    ids=["shared-memory", "process-group"],
)
@needs_ops
def test_init_destroy_cycles_release_every_group_and_its_transport(shared: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for result in launch(_cycles, 2, tmp, shared, timeout=120):
            base_fds, base_maps = result["base"]
            # Back to the baseline after every cycle (one descriptor may come and go with gloo's timing).
            extra = Counter(result["links"]) - Counter(result["base_links"])
            assert all(abs(n - base_fds) <= 1 for n in result["fds"]), extra
            assert result["maps"] == [base_maps] * CYCLES, result
            assert result["handles"][-1] <= 2, result  # not one more per cycle
            assert result["alive"] == [0] * CYCLES, result  # nothing holds a released group
            assert result["owned"] == [0] * CYCLES, result  # nor its wire
            assert result["stale"] is not None and "torch._dynamo.reset()" in result["stale"], result


def _destroyed_group(rank: int, world_size: int) -> list[Any]:
    g = dist.new_group([0, 1])
    bn = syncbn.SyncBatchNorm1d(3, process_group=g).double()
    bn(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    dist.destroy_process_group(g)
    seen = []
    for step in ("right after the destroy", "after syncbn met another group"):
        if step != "right after the destroy":
            g2 = dist.new_group([0, 1])
            other = syncbn.SyncBatchNorm1d(3, process_group=g2).double()
            x = torch.randn(4, 3, dtype=torch.float64) + rank
            y = other(x)  # the live group still synchronises: the global batch's mean is 0.5 off
            everything = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(everything, x)
            ref = torch.nn.functional.batch_norm(torch.cat(everything), None, None, training=True)
            assert (y - ref[4 * rank : 4 * rank + 4]).abs().max().item() < 1e-12
        before = {k: v.clone() for k, v in bn.state_dict().items()}
        try:
            bn(torch.randn(4, 3, dtype=torch.float64))
            message = "no error"
        except ValueError as exc:
            message = str(exc)
        unchanged = all(torch.equal(v, bn.state_dict()[k]) for k, v in before.items())
        seen.append((step, message, unchanged))
    return seen


def test_a_layer_over_a_destroyed_group_raises_before_any_state_changes() -> None:
    for seen in launch(_destroyed_group, 2, timeout=120):
        for step, message, unchanged in seen:
            assert "expected a live torch.distributed process group" in message, (step, message)
            assert "destroy_process_group(group)" in message and "nothing was changed" in message, step
            assert unchanged, step
