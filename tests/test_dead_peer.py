"""A peer killed at any instant of a training step is reported as a dead peer by every survivor.

Three ranks on shared memory train a small convolutional model with two synchronised layers; rank
2 is killed with ``SIGKILL`` at a chosen instant of a step (its own code patched in its process
only: before the forward, with its data written but its flag not raised, with its flag raised,
asleep in the wait, after a round it completed, between forward and backward, in a backward
collective, between two backward collectives) or at a random one (a timer). Every surviving rank
must raise ``CollectiveError(timed_out=False)`` naming rank 2 and its pid as dead, before the
bound. Before this test, a survivor that saw the other survivor withdraw before its own liveness
check ran said only "rank 0 of the group gave up on this collective (it found a peer process
dead)" (found by ``probe``: about a third of the survivors' messages at random instants).
"""

from __future__ import annotations

import glob
import os
import random
import signal
import threading
import time
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.dist_harness import launch
from _helpers.marks import needs_shm
from syncbn import _shm, groups

pytestmark = needs_shm

BOUND = 20.0  # syncbn's bound: a dead peer must be named well before it
VICTIM = 2
WORLD = 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DieAtChecksum:
    """``zlib`` for the victim's exchange: it dies with its slot written, its flag not yet raised."""

    def crc32(self, data: Any) -> int:
        _die()
        return zlib.crc32(data)


def _die_at_round(k: int) -> None:
    """Die at the victim's ``k``-th arrival from now (1: the next forward round), its flag raised."""
    arrived = _shm._wait.Waiter.arrived
    count = [0]

    def patched(self: Any) -> None:
        count[0] += 1
        if count[0] == k:
            _die()
        arrived(self)

    _shm._wait.Waiter.arrived = patched  # type: ignore[method-assign]


def _arm(instant: str, model: nn.Module, seed: int) -> None:
    """In the victim's process only: make it die at ``instant``."""
    if instant == "before-forward":
        _die()
    elif instant == "slot-written-flag-not-raised":
        _shm._exchange.zlib = _DieAtChecksum()  # type: ignore[assignment]
    elif instant == "flag-raised-forward":
        _die_at_round(1)
    elif instant == "flag-raised-backward":
        _die_at_round(3)  # two forward rounds (two layers), then the first backward one
    elif instant == "round-completed":
        _shm._wait.Waiter.recheck = lambda self, seq: _die()  # type: ignore[method-assign]
    elif instant == "between-backward-collectives":
        model[4].weight.register_hook(lambda grad: _die())  # after layer 4's backward round
    elif instant == "asleep-in-the-wait":
        threading.Timer(0.3, _die).start()  # the survivors start 1 s late: the victim waits for them
    elif instant.startswith("random"):
        threading.Timer(random.Random(seed).uniform(0.0, 0.05), _die).start()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        syncbn.SyncBatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        syncbn.SyncBatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def _train(rank: int, world_size: int, instant: str, seed: int) -> dict[str, Any]:
    syncbn.set_shared_memory(True)
    syncbn.set_timeout(BOUND)
    pids = torch.zeros(world_size, dtype=torch.float64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    armed = False

    def step() -> None:
        out = model(torch.randn(4, 3, 12, 12, generator=gen))
        if armed and rank == VICTIM and instant == "between-forward-and-backward":
            _die()
        out.backward(torch.randn(out.shape, generator=gen))
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # set-up and first-use handshakes done on every rank
        step()
    shared = groups.resolve(None)
    assert isinstance(shared, groups.ProcessGroupSum) and shared.uses_shared_memory
    armed = True
    if rank == VICTIM:
        _arm(instant, model, seed)
    elif instant == "asleep-in-the-wait":
        time.sleep(1.0)
    start = time.monotonic()
    try:
        for _ in range(500):
            step()
    except syncbn.CollectiveError as exc:
        return {
            "msg": str(exc),
            "timed_out": exc.timed_out,
            "waited": exc.waited,
            "s": time.monotonic() - start,
            "victim": int(pids[VICTIM]),
            "pids": [int(p) for p in pids.tolist()],
        }
    return {"msg": "no error in 500 steps", "timed_out": None, "victim": int(pids[VICTIM]), "pids": []}


INSTANTS = [
    "before-forward",
    "slot-written-flag-not-raised",
    "flag-raised-forward",
    "round-completed",
    "asleep-in-the-wait",
    "between-forward-and-backward",
    "flag-raised-backward",
    "between-backward-collectives",
    "random-1",
    "random-2",
    "random-3",
]


@pytest.mark.parametrize("instant", INSTANTS)
def test_every_survivor_names_the_dead_peer_whatever_the_instant_it_died(instant: str) -> None:
    seed = INSTANTS.index(instant)
    results = launch(_train, WORLD, instant, seed, timeout=120, allow_failures=True, finish_wait=0.5)
    killed = results[VICTIM]
    assert killed[0] == "error" and f"exit code {-signal.SIGKILL}" in killed[1], killed
    for rank, result in enumerate(results[:VICTIM]):
        assert isinstance(result, dict), (rank, result)
        victim = result["victim"]
        assert f"the process of rank(s) [{VICTIM}] of the group died (pid [{victim}])" in result["msg"], (
            rank,
            result["msg"],
        )
        assert result["timed_out"] is False, (rank, result)
        # Found by the liveness check or a peer's withdrawal, not by the bound running out.
        assert result["waited"] < BOUND and result["s"] < BOUND, (rank, result)
        for pid in result["pids"]:
            assert glob.glob(f"/dev/shm/syncbn-{pid}-*") == [], pid
