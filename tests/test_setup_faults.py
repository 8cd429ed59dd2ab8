"""Set-up under faults and overlapping groups (issue 27, item 0), on real gloo ranks.

syncbn sets a group up at its first CPU collective: the shared-memory agreement over the
process group itself, then (without shared memory) a gloo wire of its own over the same
members. These tests hold it to what held before syncbn had groups of its own:

* overlapping user groups, each reached by its members only, in a different order on
  different ranks, are exact (nothing syncbn makes needs a rank outside the user's group);
* a peer that dies before its first call is found within about a second, not at the bound;
* a peer killed while the other waits in set-up never leaves the survivor waiting past the
  bound, at any instant of the set-up;
* a rank outside ``new_group([0, 1])`` (torch hands it the int ``NON_GROUP_MEMBER``) that trains
  a layer over that group gets a ``ValueError`` naming itself and the group's ranks, nothing
  changed (it raised "cannot create weak reference to 'int' object"), while the members train
  exactly;
* a rank that does not reach a job-wide ``new_group`` made through ``groups._meet`` (as
  ``JoinableSyncBatchNorm`` needs) is named within syncbn's bound on every rank that called, no
  group made (torch's own ``new_group`` left a bare "Wait timeout"); the late rank raises too, and
  all then meet again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.dist_harness import COLLECTIVE_TIMEOUT_S, launch
from _helpers.load import Load
from syncbn import _shm, groups

BOUND = 10.0
needs_shm = pytest.mark.skipif(not _shm.supported(), reason="shared-memory path is x86-64 Linux only")
TRANSPORTS = pytest.mark.parametrize(
    "shared", [pytest.param(True, marks=needs_shm), False], ids=["shared-memory", "process-group"]
)

# Three layers over overlapping groups of 4 ranks; each rank runs those of its groups, in order.
GROUPS = ([0, 1], [1, 2, 3], [0, 1, 2, 3])
ROWS, CHANNELS = 3, 4


def _inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(27)
    xs = [torch.randn(ROWS, CHANNELS, generator=gen, dtype=torch.float64) * 2 + r for r in range(4)]
    gs = [torch.randn(ROWS, CHANNELS, generator=gen, dtype=torch.float64) for _ in range(4)]
    return xs, gs


def _reference() -> dict[str, Any]:
    """nn.BatchNorm1d over each group's concatenated batch, chained as the ranks chain the layers."""
    xs, gs = _inputs()
    leaves = [x.clone().requires_grad_() for x in xs]
    current = list(leaves)
    stats = []
    for members in GROUPS:
        bn = nn.BatchNorm1d(CHANNELS, dtype=torch.float64)
        out = bn(torch.cat([current[r] for r in members]))
        for i, r in enumerate(members):
            current[r] = out[i * ROWS : (i + 1) * ROWS]
        stats.append({k: v.clone() for k, v in bn.state_dict().items()})
    sum(((current[r] * gs[r]).sum() for r in range(4)), torch.zeros((), dtype=torch.float64)).backward()
    return {"y": [c.detach() for c in current], "grad": [x.grad for x in leaves], "stats": stats}


def _overlapping(rank: int, world_size: int, shared: bool, machines: bool = False) -> dict[str, Any]:
    syncbn.set_timeout(BOUND)
    syncbn.set_shared_memory(shared)
    if machines:  # two simulated machines, ranks {0, 1} and {2, 3}: [1, 2, 3] and the world are hierarchical
        key = 1000.0 + rank // 2
        _shm._host_key = lambda: key  # type: ignore[assignment]
    made = [dist.new_group(members) for members in GROUPS[:2]] + [None]
    layers = [syncbn.SyncBatchNorm1d(CHANNELS, process_group=g).double() for g in made]
    xs, gs = _inputs()
    x = xs[rank].clone().requires_grad_()
    y = x
    start = time.monotonic()
    for members, layer in zip(GROUPS, layers):
        if rank in members:
            y = layer(y)
    y.backward(gs[rank])
    stats = [
        {k: v.clone() for k, v in layer.state_dict().items()} if rank in members else None
        for members, layer in zip(GROUPS, layers)
    ]
    hierarchical = [groups.resolve(g).hierarchical for g, members in zip(made, GROUPS) if rank in members]
    return {
        "y": y.detach(),
        "grad": x.grad,
        "stats": stats,
        "s": time.monotonic() - start,
        "hierarchical": hierarchical,
    }


@pytest.mark.parametrize(
    "shared,machines",
    [
        pytest.param(True, False, marks=needs_shm),
        (False, False),
        pytest.param(True, True, marks=needs_shm),
    ],
    ids=["shared-memory", "process-group", "hierarchical"],
)
def test_overlapping_groups_reached_in_different_orders_are_exact(shared: bool, machines: bool) -> None:
    ref = _reference()
    results = launch(_overlapping, 4, shared, machines, timeout=60)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["y"], ref["y"][rank], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["grad"], ref["grad"][rank], rtol=1e-10, atol=1e-12)
        for members, mine, want in zip(GROUPS, got["stats"], ref["stats"]):
            if rank in members:
                for key, value in want.items():
                    torch.testing.assert_close(mine[key], value, rtol=1e-10, atol=1e-12)
        assert got["s"] < BOUND, got["s"]  # no wait for a rank outside a group (it would end at the bound)
        want = [machines and len(members) > 2 for members in GROUPS if rank in members]
        assert got["hierarchical"] == want, got["hierarchical"]


def _attempt(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"type": type(exc).__name__, "msg": str(exc), "s": time.monotonic() - start}
    return {"type": None, "msg": "", "s": time.monotonic() - start}


def _dies_before_first_call(rank: int, world_size: int, shared: bool) -> dict[str, Any]:
    syncbn.set_timeout(BOUND)
    syncbn.set_shared_memory(shared)
    bn = syncbn.SyncBatchNorm1d(3)
    if rank == 1:
        time.sleep(1.0)
        os._exit(3)  # a crash in data loading: never reaches a collective
    out = _attempt(lambda: bn(torch.randn(4, 3)))
    out["pid"] = os.getpid()
    return out


@TRANSPORTS
def test_a_peer_that_dies_before_its_first_call_is_found_within_about_a_second(shared: bool) -> None:
    results = launch(_dies_before_first_call, 2, shared, timeout=40, allow_failures=True, finish_wait=0.2)
    alive, dead = results
    assert dead[0] == "error" and "exit code 3" in dead[1], dead
    assert alive["type"] == "CollectiveError", alive
    # The peer died at ~1 s; the survivor knows within about a second of that (quiet), before the
    # bound (the ordering load cannot break: a survivor that waited for the bound says it timed out).
    assert alive["s"] < BOUND and "not every rank arrived" not in alive["msg"], alive


def _killed_while_peer_waits(rank: int, world_size: int, shared: bool, kill_after: float) -> dict[str, Any]:
    syncbn.set_timeout(BOUND)
    syncbn.set_shared_memory(shared)
    bn = syncbn.SyncBatchNorm1d(3)
    if rank == 0:
        # Killed kill_after seconds into its wait in set-up (rank 1 is still "loading data").
        threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        bn(torch.randn(4, 3))
        time.sleep(30)
        return {"type": "survived"}
    time.sleep(1.5)
    out = _attempt(lambda: [bn(torch.randn(4, 3)) for _ in range(200)])
    out["pid"] = os.getpid()
    return out


@TRANSPORTS
@pytest.mark.parametrize("kill_after", [0.5, 1.45, 1.52])
def test_a_peer_killed_while_the_other_waits_in_set_up_is_found_within_the_bound(
    shared: bool, kill_after: float
) -> None:
    # torch < 2.13: the wire is made with the bound, and gloo's first connection may wait 5x it
    # for a peer lost in the milliseconds after the presence check (docs/robustness.md states it).
    bound = BOUND if groups._own.CARRIES_TIMEOUT else 5 * BOUND
    with Load() as load:
        results = launch(
            _killed_while_peer_waits,
            2,
            shared,
            kill_after,
            timeout=bound + 30,
            allow_failures=True,
            finish_wait=0.2,
        )
    killed, other = results
    assert killed[0] == "error" and f"exit code {-signal.SIGKILL}" in killed[1], killed
    assert other["type"] == "CollectiveError", other
    if kill_after < 1.5:  # before rank 1 arrived: found at once, rank 0's connections are closed
        assert other["s"] < bound and "not every rank arrived" not in other["msg"], other
    else:  # around rank 1's set-up (its exchanges, the wire's rendezvous) or its first steps
        # At the bound: "s" counts from before rank 1's set-up, which takes seconds of its own on a
        # loaded machine (seen: 11.06 s with two suites sharing 2 cores): 3 s of quiet-machine
        # work, scaled by the load measured meanwhile.
        assert other["s"] < bound + load.margin(3.0), (other, load)


WIRE_BOUND = 2.0


def _wait_gone(pid: int) -> None:
    """Until process ``pid`` is dead (gone, or a zombie not yet reaped), at most 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def _lost_while_the_wire_connects(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 dies the moment its gloo address is in the store, before rank 1 connects to it."""
    syncbn.set_timeout(WIRE_BOUND)
    syncbn.set_shared_memory(False)
    bn = syncbn.SyncBatchNorm1d(3)
    made = dist.ProcessGroupGloo.__init__

    def late_or_dying(self: Any, store: Any, *args: Any) -> None:
        if rank == 1:  # connects once rank 0's address is published and rank 0 is gone (a fixed
            # sleep here lost the race to rank 0's watcher at a load of 20: rank 0 then connected)
            _wait_gone(int(store.get("victim").decode()))
        else:
            store.set("victim", str(os.getpid()))

            # Gloo publishes this rank's address under "<device>/<rank>" ("0/0"), then connects.
            def watch() -> None:
                store.wait(["0/0"], timedelta(seconds=30))
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=watch, daemon=True).start()
        made(self, store, *args)

    dist.ProcessGroupGloo.__init__ = late_or_dying  # type: ignore[method-assign]  # the wire's only
    out = _attempt(lambda: [bn(torch.randn(4, 3)) for _ in range(3)])
    out["pid"] = os.getpid()
    return out


@pytest.mark.parametrize("attempt", range(6))
def test_a_peer_lost_while_the_wire_connects_is_found_within_the_bound(attempt: int) -> None:
    # Gloo waits five times a group's timeout for a pair's first connection: the wire is made
    # with a fifth of the bound and raised to the bound after (torch 2.13 and later). Which side
    # of the pair waits for the other is decided by the two ports, so an attempt meets that wait
    # about every other time (before the fix: found at 10.0 s, five times the bound).
    with Load() as load:
        results = launch(_lost_while_the_wire_connects, 2, timeout=60, allow_failures=True, finish_wait=0.2)
    killed, other = results
    assert killed[0] == "error" and f"exit code {-signal.SIGKILL}" in killed[1], killed
    assert other["type"] == "CollectiveError", other
    limit = WIRE_BOUND if groups._own.CARRIES_TIMEOUT else 5 * WIRE_BOUND
    assert other["s"] < limit + load.margin(2.0), (other, load)  # 2 s of set-up work, quiet


def _non_member(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(BOUND)
    pair = dist.new_group([0, 1])  # rank 2: torch.distributed.GroupMember.NON_GROUP_MEMBER
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(8, 3, 2, 2, generator=gen, dtype=torch.float64) * 3 + 1
    layers = {
        "bn": syncbn.SyncBatchNorm2d(3, process_group=pair),
        "inplace": syncbn.InPlaceSyncBatchNorm2d(3, process_group=pair, activation="identity"),
        "renorm": syncbn.SyncBatchRenorm2d(3, process_group=pair, r_max=1.0, d_max=0.0),
    }
    out: dict[str, Any] = {}
    for name, layer in layers.items():
        layer.double()
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        x = full[4 * min(rank, 1) : 4 * min(rank, 1) + 4].clone()
        given = x.clone()
        try:
            y = layer(x)
        except ValueError as exc:
            out[name] = str(exc)
        else:  # a member: the pair's big batch (renorm with r_max=1, d_max=0 is batch norm)
            reference = nn.BatchNorm2d(3).double()
            out[name] = (y.detach() - reference(full)[4 * rank : 4 * rank + 4]).abs().max().item()
            out[f"{name} running"] = (layer.running_var - reference.running_var).abs().max().item()
        after = layer.state_dict()
        out[f"{name} unchanged"] = all(torch.equal(before[k], after[k]) for k in before) and bool(
            torch.equal(x, given)
        )
    return out


def test_a_rank_outside_the_group_is_told_so_and_the_members_train() -> None:
    results = launch(_non_member, 3, timeout=90)
    for rank in (0, 1):
        for name in ("bn", "inplace", "renorm"):
            if name == "bn":  # (the in-place layer's scale is |weight| + eps: its output is close only)
                assert results[rank][name] < 1e-12, (rank, name, results[rank])
            assert results[rank][f"{name} running"] < 1e-12, (rank, name, results[rank])
    outside = results[2]
    for name in ("bn", "inplace", "renorm"):
        text = outside[name]
        assert text.startswith("syncbn: expected a process group that global rank 2 belongs to"), text
        assert "NON_GROUP_MEMBER (-100)" in text and "global ranks [0, 1]" in text, text
        assert "syncbn.groups.subgroup(k)" in text and "nothing was changed" in text, text
        assert outside[f"{name} unchanged"], (name, outside)


def _absent_from_new_group(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(1.5)
    everyone = list(range(world_size))
    caller = "syncbn.JoinableSyncBatchNorm(model)"
    out: dict[str, Any] = {}
    if rank == 1:
        time.sleep(6.0)  # well past the others' bound: rank-dependent code before the call
    try:
        groups._meet.new_group(caller, everyone, None)
        out["first"] = "made"
    except syncbn.CollectiveError as exc:
        out["first"] = str(exc)
        out["timed out"] = exc.timed_out
        out["waited"] = exc.waited
    out["groups after"] = len(dist.distributed_c10d._world.pg_map)
    dist.barrier()  # every rank past its first try (the default group is still usable)
    group = groups._meet.new_group(caller, everyone, None)  # all on time: the next epoch
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    out["summed"] = total.item()
    return out


def test_a_rank_absent_from_a_job_wide_new_group_is_named_within_the_bound() -> None:
    results = launch(_absent_from_new_group, 3, timeout=90)
    for rank in (0, 2):
        text = results[rank]["first"]
        assert text.startswith(
            "syncbn.JoinableSyncBatchNorm(model) is collective over every rank of the job"
        ), text
        assert "global ranks [1] did not" in text and "bound: 1.5 s" in text, text
        assert "No group was made" in text, text
        assert results[rank]["timed out"] is True
        assert results[rank]["waited"] < COLLECTIVE_TIMEOUT_S  # syncbn's bound, not the group's
    late = results[1]["first"]  # alone in the next meeting: it gives up at the bound too
    assert "JoinableSyncBatchNorm" in late and "global ranks [0, 2] did not" in late, late
    assert len({out["groups after"] for out in results}) == 1  # no rank made a group
    assert [out["summed"] for out in results] == [3.0, 3.0, 3.0]
