"""``syncbn.groups.subgroup``: groups of k ranks or of one machine, made safely, exact within each group.

One launch of 4 gloo ranks checks groups of 2 and of 1 (the verify matrix: uneven and empty
batches, momentum None, dtypes, against ``nn.BatchNorm`` on the group's batch in float64), the
in-place family, ``convert_sync_batchnorm(group_size=...)``, the cache, the shared-memory path,
errors that name the group, and fresh groups after ``destroy_process_group`` + a new job.
``"node"`` on two simulated hosts (``tests/_helpers/netns.py``) is in the last test.

A rank that does not call ``subgroup`` (directly or through ``convert_sync_batchnorm(group_size=)``)
is named within syncbn's bound by every rank that did, nothing made or converted; it once left them
in ``all_gather_object`` for the process group's timeout, then a raw gloo error.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers import netns as _netns
from _helpers.dist_harness import COLLECTIVE_TIMEOUT_S, launch
from _helpers.renorm_reference import renorm_reference
from syncbn import groups
from syncbn.cli._checks import run_case, standard_cases

pytestmark = pytest.mark.timeout(180)

TOL = 1e-11


def _matrix(rank: int, group: Any) -> float:
    """Worst float64 error of the verify matrix's float64 cases on ``group``."""
    worst = 0.0
    for case in standard_cases(dist.get_world_size(group)):
        if case.dtype != torch.float64 or "mean1000" in case.name:
            continue
        errors = run_case(case, rank, group=group, group_rank=dist.get_rank(group))
        worst = max([worst] + [v for k, v in errors.items() if k != "num_batches_tracked"])
        assert errors.get("num_batches_tracked", 0.0) == 0.0, case.name
    return worst


def _inplace(group: Any) -> float:
    """In-place layer on ``group`` against BatchNorm (weight |w| + eps) + leaky_relu on the group's batch."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    sizes = [2, 0, 3, 1][:size] if size > 1 else [3]
    gen = torch.Generator().manual_seed(5)
    ours = syncbn.InPlaceSyncBatchNorm2d(3, process_group=group, activation="leaky_relu").double()
    ref = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        w = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
        ours.weight.copy_(w)
        ref.weight.copy_(w + ours.eps)
    worst = 0.0
    for _ in range(2):
        full = torch.randn(sum(sizes), 3, 4, 4, generator=gen, dtype=torch.float64) * 2 + 1
        lo = sum(sizes[:me])
        expected = nn.functional.leaky_relu(ref(full), 0.01)[lo : lo + sizes[me]]
        got = ours(full[lo : lo + sizes[me]].clone())
        worst = max(worst, (got - expected).abs().max().item() if got.numel() else 0.0)
    worst = max(worst, (ours.running_var - ref.running_var).abs().max().item())
    return worst


def _renorm(group: Any) -> float:
    """Batch Renormalization on ``group`` against its formulas on the group's batch (clamps active)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    sizes = [2, 0, 3, 1][:size] if size > 1 else [3]
    gen = torch.Generator().manual_seed(6)
    ours = syncbn.SyncBatchRenorm2d(3, process_group=group, r_max=1.5, d_max=0.4).double()
    with torch.no_grad():
        ours.running_mean.uniform_(-1.0, 1.0, generator=gen)
        ours.running_var.uniform_(0.3, 3.0, generator=gen)
        ours.weight.uniform_(0.5, 1.5, generator=gen)
    rm, rv = ours.running_mean.clone(), ours.running_var.clone()
    worst = 0.0
    for _ in range(2):
        full = torch.randn(sum(sizes), 3, 4, 4, generator=gen, dtype=torch.float64) * 2 + 1
        lo = sum(sizes[:me])
        expected, rm, rv = renorm_reference(full, ours.weight.detach(), ours.bias.detach(), rm, rv, 1.5, 0.4)
        got = ours(full[lo : lo + sizes[me]].clone())
        worst = max(worst, (got - expected[lo : lo + sizes[me]]).abs().max().item() if got.numel() else 0.0)
    worst = max(
        worst, (ours.running_mean - rm).abs().max().item(), (ours.running_var - rv).abs().max().item()
    )
    return worst


def _ranks(rank: int, world: int, second_store: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    syncbn.set_timeout(20.0)
    # Ranks that ask for different sizes (before anything is cached): the same error on every
    # rank, nothing made.
    try:
        groups.subgroup(2 if rank < 2 else 4)
    except ValueError as exc:
        out["differ"] = str(exc)
    pairs = groups.subgroup(2)
    out["pairs"] = groups.group_ranks(pairs)
    out["cached"] = groups.subgroup(2) is pairs
    out["pairs error"] = _matrix(rank, pairs)
    out["pairs inplace"] = _inplace(pairs)
    out["pairs renorm"] = _renorm(pairs)
    summed = groups.resolve(pairs)
    out["shared memory"] = isinstance(summed, groups.ProcessGroupSum) and summed.uses_shared_memory

    singles = groups.subgroup(1)
    out["singles"] = groups.group_ranks(singles)
    out["singles error"] = _matrix(rank, singles)
    out["singles inplace"] = _inplace(singles)
    out["singles renorm"] = _renorm(singles)
    out["whole"] = groups.subgroup(4) is dist.group.WORLD

    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), syncbn.InPlaceSyncBatchNorm2d(3))
    model = syncbn.convert_sync_batchnorm(model, group_size=2)
    out["converted"] = [m.process_group is pairs for m in (model[1], model[2])]
    # A saved layer names its group by its global ranks and finds it again when it next trains.
    loaded = pickle.loads(pickle.dumps(model[1].double()))
    loaded(torch.randn(2, 3, 2, 2, dtype=torch.float64))
    out["reloaded"] = loaded.process_group is pairs

    for bad in (3, 0, "nodes", 2.0):
        try:
            groups.subgroup(bad)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            out[f"error {bad!r}"] = f"{type(exc).__name__}: {exc}"
    try:
        syncbn.convert_sync_batchnorm(nn.BatchNorm1d(2), process_group=pairs, group_size=2)
    except ValueError as exc:
        out["both"] = str(exc)

    # Errors inside a group: a disagreement is raised on both of its ranks (and no other); a
    # rank that skips the layer makes its peer give up at the bound, naming the group.
    if rank >= 2:
        layer = syncbn.SyncBatchNorm2d(3 if rank == 2 else 4, process_group=pairs).double()
        try:
            layer(torch.randn(2, layer.num_features, 2, 2, dtype=torch.float64))
        except ValueError as exc:
            out["mismatch"] = str(exc)
    dist.barrier()
    if rank >= 2:
        syncbn.set_timeout(2.0)
        layer = syncbn.SyncBatchNorm2d(3, process_group=pairs).double()
        if rank == 2:
            try:
                layer(torch.randn(2, 3, 2, 2, dtype=torch.float64))
            except syncbn.CollectiveError as exc:
                out["timeout"] = str(exc)
    dist.barrier()

    # A new job after destroy_process_group: fresh groups, not the destroyed ones.
    dist.destroy_process_group()
    store = dist.FileStore(second_store, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    again = groups.subgroup(2)
    out["fresh"] = again is not pairs and groups.group_ranks(again) == out["pairs"]
    out["fresh error"] = _matrix(rank, again)
    dist.barrier()
    return out


def test_groups_of_two_and_one_on_four_ranks() -> None:
    with tempfile.TemporaryDirectory(prefix="syncbn-subgroups-") as tmp:
        results = launch(_ranks, 4, os.path.join(tmp, "second"), timeout=170)
    for rank, out in enumerate(results):
        assert isinstance(out, dict), out
        assert out["pairs"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["singles"] == [rank]
        assert out["cached"] and out["whole"] and out["fresh"]
        assert out["converted"] == [True, True] and out["reloaded"]
        assert out["shared memory"] is True
        for key in (
            "pairs error",
            "pairs inplace",
            "pairs renorm",
            "singles error",
            "singles inplace",
            "singles renorm",
            "fresh error",
        ):
            assert out[key] < TOL, (rank, key, out[key])
        assert out["error 3"] == (
            "ValueError: syncbn.groups.subgroup: expected a group size that divides the world size 4 "
            "(got group size 3)"
        )
        assert out["error 0"].startswith("ValueError") and "(got group size 0)" in out["error 0"]
        assert out["error 'nodes'"].startswith("TypeError") and "'node'" in out["error 'nodes'"]
        assert out["error 2.0"].startswith("TypeError")
        assert "not both" in out["both"]
        assert out["differ"] == (
            "syncbn.groups.subgroup: expected the same size on every rank "
            "(got rank 0: 2, rank 1: 2, rank 2: 4, rank 3: 4); no group was made"
        )
        if rank >= 2:
            assert "disagree on the channel count" in out["mismatch"], out["mismatch"]
        if rank == 2:
            assert "global ranks [2, 3]" in out["timeout"], out["timeout"]


def test_subgroup_needs_an_initialised_job() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        groups.subgroup(2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        syncbn.convert_sync_batchnorm(nn.BatchNorm1d(2), group_size="node")


_WHY = _netns.available()


def _node(rank: int, world: int, directory: str) -> dict[str, Any]:
    syncbn.set_timeout(20.0)
    node = groups.subgroup("node")
    summed = groups.resolve(node)
    error = _matrix(rank, node)
    return {
        "ranks": groups.group_ranks(node),
        "error": error,
        "inplace": _inplace(node),
        "shared": isinstance(summed, groups.ProcessGroupSum) and summed.uses_shared_memory,
        "pairs": groups.group_ranks(groups.subgroup(2)),
    }


@pytest.mark.skipif(bool(_WHY), reason=_WHY or "-")
def test_node_groups_on_two_simulated_hosts() -> None:
    with _netns.Hosts(2) as hosts:
        results = hosts.launch(_node, [2, 2]).wait(120)
    for rank, out in enumerate(results):
        assert isinstance(out, dict), out
        assert out["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["pairs"] == out["ranks"]
        assert out["shared"] is True  # each machine's group takes its shared memory
        assert out["error"] < TOL and out["inplace"] < TOL, (rank, out)


def _late(gave_up: Any, others: int) -> None:
    """Return once ``others`` ranks have given up on this one (at most 60 s): well past their bound."""
    deadline = time.monotonic() + 60.0
    while int(gave_up.add("gave up", 0)) < others and time.monotonic() < deadline:
        time.sleep(0.01)


def _absent(rank: int, world: int, signal: str) -> dict[str, Any]:
    syncbn.set_timeout(1.5)
    gave_up = dist.FileStore(signal, world)  # not the job's store: the ranks' own signal
    out: dict[str, Any] = {}
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    calls = {
        0: lambda: syncbn.convert_sync_batchnorm(model, group_size=1),
        1: lambda: (_late(gave_up, world - 1), groups.subgroup(1)),  # only once the others gave up
        2: lambda: groups.subgroup(1),
    }
    try:
        calls[rank]()
        out["first"] = "made"
    except syncbn.CollectiveError as exc:
        out["first"] = str(exc)
        out["waited"] = exc.waited
        out["timed out"] = exc.timed_out
    if rank != 1:
        gave_up.add("gave up", 1)
    out["unconverted"] = type(model[1]) is nn.BatchNorm1d
    out["groups after"] = len(dist.distributed_c10d._world.pg_map)
    dist.barrier()  # the default group is still usable; now every rank asks, on time
    mine = groups.subgroup(1)
    out["ranks"] = groups.group_ranks(mine)
    converted = syncbn.convert_sync_batchnorm(model, group_size=1)
    out["converted"] = converted[1].process_group is mine
    return out


def test_a_rank_that_does_not_call_subgroup_is_named_within_the_bound() -> None:
    with tempfile.TemporaryDirectory(prefix="syncbn-subgroups-") as tmp:
        results = launch(_absent, 3, os.path.join(tmp, "signal"), timeout=90)
    for rank in (0, 2):
        text = results[rank]["first"]
        assert text.startswith("syncbn.groups.subgroup(1) is collective over every rank of the job"), text
        assert "global ranks [1] did not" in text and "bound: 1.5 s" in text, text
        assert "No group was made" in text, text
        assert results[rank]["timed out"] is True
        assert results[rank]["waited"] < COLLECTIVE_TIMEOUT_S  # syncbn's bound, not the group's
    assert "global ranks [0, 2] did not" in results[1]["first"], results[1]  # late: it gives up too
    assert len({out["groups after"] for out in results}) == 1  # no rank made a group
    for rank, out in enumerate(results):
        assert out["unconverted"] and out["converted"] and out["ranks"] == [rank], out
