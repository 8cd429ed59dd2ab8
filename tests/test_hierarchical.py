"""The hierarchical path: machine groups through shared memory, leaders over gloo (simulated machines).

Four real gloo ranks on this machine are told they sit on two machines (ranks 0-1 and 2-3) by
giving each pair its own host key; every collective then takes the three steps of
:mod:`syncbn.groups._hier`. Checked: the sums are exact and bit-identical on every rank, the
layer equals ``nn.BatchNorm`` on the global batch (float64, random upstream gradient), and a
mismatch between the machines is an error on every rank at once (``shadow_sum`` is refused).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import syncbn
from _helpers.dist_harness import launch
from _helpers.load import Load
from _helpers.marks import needs_shm
from syncbn import _shm, groups

pytestmark = needs_shm

WORLD = 4
C = 5


def _machine(rank: int) -> None:
    key = 1000.0 + rank // 2  # two simulated machines: ranks {0, 1} and {2, 3}
    _shm._host_key = lambda: key  # type: ignore[assignment]


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3 + rank, C, 4, 2, generator=gen, dtype=torch.float64) * 3 + 1.5
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    return x, dy


def _hierarchical(rank: int, world_size: int) -> dict[str, Any]:
    _machine(rank)
    group = groups.ProcessGroupSum(None, hierarchical=True)
    ints = torch.arange(7, dtype=torch.float64) * (rank + 1)
    group.all_reduce_sum(ints, groups.Tag(3, groups.PHASE_OTHER))
    gen = torch.Generator().manual_seed(rank)
    noisy = torch.randn(300, generator=gen, dtype=torch.float64).float()
    group.all_reduce_sum(noisy, groups.Tag(4, groups.PHASE_OTHER))
    strided = (torch.arange(6, dtype=torch.float64) * (rank + 1)).view(2, 3).t()  # not contiguous
    group.all_reduce_sum(strided, groups.Tag(5, groups.PHASE_OTHER))
    hier = group._hier  # noqa: SLF001 - the structure under test
    layer = syncbn.SyncBatchNorm2d(C, process_group=group).double()
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, C))
        layer.bias.copy_(torch.linspace(-1, 1, C))
    x, dy = _data(rank)
    x.requires_grad_(True)
    out = layer(x)
    out.backward(dy)
    return {
        "hierarchical": group.hierarchical,
        "machines": None if hier is None else hier.machines,
        "leader": None if hier is None else hier.cross is not None,
        "local_shm": None if hier is None or hier.local is None else hier.local.uses_shared_memory,
        "ints": ints.tolist(),
        "strided": strided.tolist(),
        "noisy": noisy.numpy().tobytes(),
        "out": out.detach(),
        "gx": x.grad,
        "gw": layer.weight.grad.numpy().tobytes(),
        "gb": layer.bias.grad.numpy().tobytes(),
        "rm": layer.running_mean.clone(),
        "rv": layer.running_var.clone(),
        "hier_repr": repr(group),
    }


@pytest.mark.timeout(300)
def test_hierarchical_sums_are_exact_bit_identical_and_equal_batchnorm() -> None:
    results = launch(_hierarchical, WORLD, timeout=240)
    assert [r["hierarchical"] for r in results] == [True] * WORLD
    assert [r["machines"] for r in results] == [2] * WORLD
    assert [r["leader"] for r in results] == [True, False, True, False]
    assert all(r["local_shm"] for r in results)
    expected_ints = (torch.arange(7, dtype=torch.float64) * sum(r + 1 for r in range(WORLD))).tolist()
    assert len({r["noisy"] for r in results}) == 1, "the sum differs between ranks"
    gens = [torch.Generator().manual_seed(r) for r in range(WORLD)]
    noisy = [torch.randn(300, generator=g, dtype=torch.float64).float() for g in gens]
    exact = torch.stack([n.double() for n in noisy]).sum(0)
    got = torch.frombuffer(bytearray(results[0]["noisy"]), dtype=torch.float32)
    assert torch.allclose(got.double(), exact, rtol=1e-6, atol=1e-6)
    strided = (torch.arange(6, dtype=torch.float64) * sum(r + 1 for r in range(WORLD))).view(2, 3).t()
    for r in results:
        assert r["ints"] == expected_ints
        assert r["strided"] == strided.tolist(), "a non-contiguous tensor's sum"
    # The layer against nn.BatchNorm2d on the global batch.
    xs, dys = zip(*(_data(r) for r in range(WORLD)))
    x = torch.cat(xs).requires_grad_(True)
    ref = nn.BatchNorm2d(C).double()
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, C))
        ref.bias.copy_(torch.linspace(-1, 1, C))
    out = ref(x)
    out.backward(torch.cat(dys))
    sizes = [len(xi) for xi in xs]
    for rank, (r, o, g) in enumerate(zip(results, out.split(sizes), x.grad.split(sizes))):
        torch.testing.assert_close(r["out"], o.detach(), rtol=1e-10, atol=1e-10, msg=f"rank {rank} out")
        torch.testing.assert_close(r["gx"], g, rtol=1e-10, atol=1e-10, msg=f"rank {rank} grad")
        torch.testing.assert_close(r["rm"], ref.running_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["rv"], ref.running_var, rtol=1e-10, atol=1e-12)
    # The parameter gradients are each rank's own part (DDP sums them): their sum is the reference's.
    gw = sum(torch.frombuffer(bytearray(r["gw"]), dtype=torch.float64) for r in results)
    gb = sum(torch.frombuffer(bytearray(r["gb"]), dtype=torch.float64) for r in results)
    torch.testing.assert_close(gw, ref.weight.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gb, ref.bias.grad, rtol=1e-10, atol=1e-10)


def _leaders_disagree(rank: int, world_size: int) -> dict[str, Any]:
    _machine(rank)
    group = groups.ProcessGroupSum(None, hierarchical=True)
    group.all_reduce_sum(torch.ones(3, dtype=torch.float64))  # set-up
    with pytest.raises(groups.CollectiveError) as refused:  # on every rank, nothing sent
        group.shadow_sum()
    layer_id = 7 if rank < 2 else 8  # the two machines call different layers
    try:
        group.all_reduce_sum(torch.ones(3, dtype=torch.float64), groups.Tag(layer_id, groups.PHASE_FORWARD))
    except groups.CollectiveError as exc:
        after = torch.ones(2, dtype=torch.float64)
        group.all_reduce_sum(after, groups.Tag(9, groups.PHASE_OTHER))  # still usable
        return {
            "mismatch": exc.mismatch,
            "timed_out": exc.timed_out,
            "after": after.tolist(),
            "refused": str(refused.value),
        }
    return {"mismatch": None}


@pytest.mark.timeout(300)
def test_a_mismatch_between_machines_is_an_error_on_every_rank_and_the_group_stays_usable() -> None:
    for rank, result in enumerate(launch(_leaders_disagree, WORLD, timeout=240)):
        assert result["mismatch"] is True, (rank, result)
        assert result["timed_out"] is False
        assert result["after"] == [4.0, 4.0]
        assert "shadow_sum (DDP Join) is not available on a hierarchical group" in result["refused"]


def _single_machine(rank: int, world_size: int) -> dict[str, Any]:
    group = groups.ProcessGroupSum(None, hierarchical=True)
    t = torch.ones(2, dtype=torch.float64)
    group.all_reduce_sum(t)
    return {"hierarchical": group.hierarchical, "shm": group.uses_shared_memory, "t": t.tolist()}


def test_on_one_machine_the_flat_shared_memory_path_is_kept() -> None:
    for result in launch(_single_machine, 3, timeout=120):
        assert result == {"hierarchical": False, "shm": True, "t": [3.0, 3.0]}


# ------------------------------------------------- failures are failures, never mismatches (issue 23)


def _peer_killed(rank: int, world_size: int, victim: int) -> dict[str, Any]:
    import os
    import signal
    import time

    syncbn.set_timeout(5.0)
    _machine(rank)
    group = groups.ProcessGroupSum(None, hierarchical=True)
    layer = syncbn.SyncBatchNorm1d(3, process_group=group)
    layer(torch.randn(4, 3))  # set-up and the handshake on every rank
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        layer(torch.randn(4, 3))
    except syncbn.CollectiveError as exc:
        return {"mismatch": exc.mismatch, "s": time.monotonic() - start, "msg": str(exc)}
    return {"mismatch": None, "s": time.monotonic() - start, "msg": ""}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [2, 3], ids=["leader-of-machine-1", "member-of-machine-1"])
def test_a_dead_rank_is_a_failure_on_every_rank_never_a_mismatch(victim: int) -> None:
    with Load() as load:
        results = launch(_peer_killed, WORLD, victim, timeout=90, allow_failures=True, finish_wait=0.5)
    assert results[victim][0] == "error" and "exit code -9" in results[victim][1]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(result, dict) and result["mismatch"] is False, (rank, result)
        # At the latest at the 5 s bound, then 2 s of quiet-machine work at the load measured.
        assert result["s"] < 5.0 + load.margin(2.0), (rank, result, load)
        assert "phase 1" not in result["msg"] and "did not make the same collective" not in result["msg"]


def _setting_on_some_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import os

    _machine(rank)
    if rank in (0, 3):
        os.environ["SYNCBN_HIERARCHICAL"] = "1"
    else:
        os.environ["SYNCBN_HIERARCHICAL"] = "0"
    layer = syncbn.SyncBatchNorm1d(3)
    try:
        layer(torch.randn(4, 3))
    except syncbn.CollectiveError as exc:
        return {"mismatch": exc.mismatch, "msg": str(exc)}
    return {"mismatch": None, "msg": ""}


@pytest.mark.timeout(120)
def test_a_setting_made_on_some_ranks_only_is_named_on_every_rank() -> None:
    for rank, result in enumerate(launch(_setting_on_some_ranks, WORLD, timeout=90)):
        assert result["mismatch"] is True, (rank, result)
        assert "SYNCBN_HIERARCHICAL" in result["msg"], result["msg"]
        assert "[0, 3] chose it and [1, 2] did not" in result["msg"], result["msg"]
        assert "order" not in result["msg"], result["msg"]


def _two_groups_of_the_same_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    syncbn.set_timeout(20.0)
    _machine(rank)
    first = groups.ProcessGroupSum(None, hierarchical=True)
    second = groups.ProcessGroupSum(dist.new_group(list(range(world_size))), hierarchical=True)
    third = groups.ProcessGroupSum(None, hierarchical=True)
    sums = []
    for group in (first, second, third, first):
        t = torch.full((3,), float(rank + 1), dtype=torch.float64)
        group.all_reduce_sum(t)
        sums.append(t.tolist())
    return {"hier": [g.hierarchical for g in (first, second, third)], "sums": sums}


@pytest.mark.timeout(120)
def test_several_hierarchical_groups_of_the_same_ranks_set_up_and_sum() -> None:
    # Subgroups made by their members only are named after their ranks: a second one of the same
    # ranks used to meet the first one's rendezvous and hang.
    for result in launch(_two_groups_of_the_same_ranks, WORLD, timeout=90):
        assert result == {"hier": [True] * 3, "sums": [[10.0] * 3] * 4}, result


def _default_and_override(rank: int, world_size: int) -> dict[str, Any]:
    import os

    _machine(rank)
    os.environ.pop("SYNCBN_HIERARCHICAL", None)
    default = groups.ProcessGroupSum(None)
    default.all_reduce_sum(torch.ones(2, dtype=torch.float64))
    os.environ["SYNCBN_HIERARCHICAL"] = "0"
    off = groups.ProcessGroupSum(None)
    t = torch.ones(2, dtype=torch.float64)
    off.all_reduce_sum(t)
    return {"default": default.hierarchical, "off": off.hierarchical, "sum": t.tolist()}


@pytest.mark.timeout(120)
def test_a_group_spanning_machines_is_hierarchical_by_default_and_the_setting_overrides_it() -> None:
    for result in launch(_default_and_override, WORLD, timeout=90):
        assert result == {"default": True, "off": False, "sum": [4.0, 4.0]}, result
