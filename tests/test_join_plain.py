"""The plain ``Join([ddp])`` a user writes, over a model with syncbn layers (issue 23, item 1).

Uneven inputs (rank 0 has 3 batches, rank 1 has 2) under ``with Join([ddp]):`` without
``syncbn.JoinableSyncBatchNorm`` used to end in a CollectiveError after the bound on one rank and
a gloo timeout on the other (shared memory), or in a SIGABRT inside gloo (process group). Now
every rank raises at once, at the first syncbn collective inside the Join, an error naming
``syncbn.JoinableSyncBatchNorm``, with the layer's state unchanged; the joinable way then trains
exactly, and training after it needs no Join. Real gloo ranks, both transports, bounded.
"""

from __future__ import annotations

import copy
import glob
import inspect
import os
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

import syncbn
from _helpers.dist_harness import COLLECTIVE_TIMEOUT_S, launch
from _helpers.marks import needs_shm
from syncbn.groups import UnboundedStepWarning

TRANSPORTS = pytest.mark.parametrize(
    "shared", [pytest.param(True, marks=needs_shm), False], ids=["shared-memory", "process-group"]
)


# DDP without its forward buffer broadcast (the argument's name changed in torch 2.13).
_DDP_ARGS = inspect.signature(nn.parallel.DistributedDataParallel).parameters
_NO_BUFFER_SYNC = {
    "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers": False
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).double()


def _batches(rank: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(count)]


def _train(ddp: nn.Module, batches: list[torch.Tensor]) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in batches:
        opt.zero_grad()
        ddp(x).pow(2).sum().backward()
        opt.step()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _plain_join(rank: int, world_size: int, shared: bool) -> dict[str, Any]:
    syncbn.set_timeout(5.0)
    syncbn.set_shared_memory(shared)
    out: dict[str, Any] = {"pid": os.getpid()}
    # DDP's buffer broadcast (the first collective of a step) waits up to the group's timeout, 30 s
    # here, over 2x syncbn's bound: warned once per process; not with broadcast_buffers=False.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = nn.parallel.DistributedDataParallel(_model(), **_NO_BUFFER_SYNC)
        _train(quiet, _batches(rank, 1))
        out["warned_quiet"] = sum(issubclass(w.category, UnboundedStepWarning) for w in caught)
        ddp = nn.parallel.DistributedDataParallel(_model())
        _train(ddp, _batches(rank, 2))  # the layer is set up (handshake, transport) before the Join
        _train(quiet, _batches(rank, 1))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UnboundedStepWarning)]
    before = _buffers(ddp)
    start = time.monotonic()
    try:
        with Join([ddp]):
            _train(ddp, _batches(rank, 3 - rank))
        out["plain"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["plain"] = (type(exc).__name__, str(exc))
    out["plain_s"] = time.monotonic() - start
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in _buffers(ddp).items())

    # The same model, the same uneven inputs, the joinable way: exact, and training goes on after it.
    with Join([syncbn.JoinableSyncBatchNorm(ddp), ddp]):
        _train(ddp, _batches(rank, 3 - rank))
    _train(ddp, _batches(rank + 5, 1))  # after the Join: no Join needed
    out["after_joinable"] = _buffers(ddp)

    # A plain Join that trained no syncbn layer (an evaluation loop) leaves its configuration on
    # the model; a later training loop, outside any Join, is not refused.
    with Join([ddp]):
        with torch.no_grad():
            ddp.eval()(_batches(rank, 1)[0])
    ddp.train()
    try:
        _train(ddp, _batches(rank, 1))
        out["later"] = None
    except Exception as exc:  # noqa: BLE001
        out["later"] = type(exc).__name__
    # Nor after a plain Join that was refused (it ended through the exception).
    try:
        with Join([ddp]):
            _train(ddp, _batches(rank, 1))
    except syncbn.groups.PlainJoinError:
        out["refused_again"] = True
    _train(ddp, _batches(rank, 1))
    out["final"] = _buffers(ddp)
    return out


@TRANSPORTS
def test_plain_join_raises_on_every_rank_at_once_naming_the_joinable(shared: bool) -> None:
    results = launch(_plain_join, 2, shared, timeout=90)
    for r in results:
        assert r["warned_quiet"] == 0 and len(r["warnings"]) == 1, r["warnings"]
        assert "broadcast_buffers=False" in r["warnings"][0] and "(30 s)" in r["warnings"][0]
        assert r["plain"] is not None, r
        kind, text = r["plain"]
        assert kind == "PlainJoinError", r["plain"]
        assert "syncbn.JoinableSyncBatchNorm" in text
        assert "Join([syncbn.JoinableSyncBatchNorm(ddp), ddp])" in text
        assert r["plain_s"] < 5.0, r["plain_s"]  # at once: before the 5 s bound a wait would reach
        assert r["unchanged"], "the refused step changed the model"
        assert r["later"] is None and r["refused_again"]
        assert glob.glob(f"/dev/shm/syncbn-{r['pid']}-*") == []
    first, second = results
    for key in ("after_joinable", "final"):
        assert all(torch.equal(first[key][k], second[key][k]) for k in first[key]), key


def _plain_batchnorm_control(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double())
    start = time.monotonic()
    with Join([ddp]):
        _train(ddp, _batches(rank, 3 - rank))
    return time.monotonic() - start


def test_the_plain_join_with_plain_batchnorm_is_untouched() -> None:
    for seconds in launch(_plain_batchnorm_control, 2, timeout=60):
        assert seconds < COLLECTIVE_TIMEOUT_S  # no wait for the process group's timeout


# ----------------------------------------- torch's pattern: Join(..., throw_on_early_termination=True)


def _throwing_join(rank: int, world_size: int, layer: str, shared: bool) -> dict[str, Any]:
    """torch's documented SyncBatchNorm pattern for uneven inputs: rank 0 has 4 batches, rank 1 has 2."""
    syncbn.set_timeout(5.0)
    syncbn.set_shared_memory(shared)
    torch.manual_seed(0)
    norm = syncbn.SyncBatchNorm1d(4) if layer == "syncbn" else nn.BatchNorm1d(4)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 1)).double())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    copied = copy.deepcopy(ddp)  # syncbn's join hook follows the copy, never the original
    hooks = Join([copied], enable=False)._join_hooks
    copied_ok = all(getattr(getattr(h, "inner", h), "ddp", None) is copied for h in hooks)
    steps = 0
    start = time.monotonic()
    error = None
    try:
        with ddp.join(throw_on_early_termination=True):
            for x in _batches(rank, 4 - 2 * rank):
                opt.zero_grad()
                ddp(x).pow(2).sum().backward()
                opt.step()
                steps += 1
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        error = (type(exc).__name__, str(exc))
    out: dict[str, Any] = {"error": error, "steps": steps, "s": time.monotonic() - start, "copy": copied_ok}
    # Training goes on afterwards on the same model, outside any Join, on every rank.
    _train(ddp, _batches(rank + 7, 1))
    out["params"] = [p.detach().clone() for p in ddp.parameters()]
    return out


@pytest.mark.parametrize(
    "shared", [pytest.param(True, marks=needs_shm), False], ids=["shared-memory", "process-group"]
)
def test_torchs_throw_on_early_termination_pattern_behaves_as_with_batchnorm(shared: bool) -> None:
    control = launch(_throwing_join, 2, "batchnorm", shared, timeout=60)
    got = launch(_throwing_join, 2, "syncbn", shared, timeout=60)
    for mine, theirs in zip(got, control):
        assert mine["error"] == theirs["error"], (mine["error"], theirs["error"])
        assert mine["steps"] == theirs["steps"]
        assert mine["s"] < 5.0, mine["s"]  # at once: before the 5 s bound a wait would reach
        assert mine["copy"]
    assert got[0]["error"][0] == "RuntimeError" and "Detected at least one rank" in got[0]["error"][1]
    assert got[1]["error"][0] == "RuntimeError" and "exhausted all inputs" in got[1]["error"][1]
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)
