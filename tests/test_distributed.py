"""syncbn on real gloo process groups equals nn.BatchNorm on the global batch."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import syncbn
from _helpers.dist_harness import launch, launch_once
from _helpers.equivalence import Case, run_case, run_standard_cases, standard_cases, tolerance
from _helpers.modules import CountingGroup


def _results(world_size: int) -> list[dict[str, Any]]:
    return launch_once(run_standard_cases, world_size, timeout=240)


@pytest.mark.parametrize("world_size, name", [(w, c.name) for w in (2, 3, 4) for c in standard_cases(w)])
def test_matches_global_batchnorm(world_size: int, name: str) -> None:
    case = next(c for c in standard_cases(world_size) if c.name == name)
    tol = tolerance(case)
    for rank, result in enumerate(_results(world_size)):
        errors = result[name]
        assert isinstance(errors, dict), f"rank {rank}: {errors}"
        assert errors["nan"] == 0.0, f"rank {rank}: non-finite values"
        if "num_batches_tracked" in errors:
            assert errors["num_batches_tracked"] == 0.0
        for key, value in errors.items():
            assert value <= tol, f"rank {rank} {key}: error {value:.3g} > {tol:.3g}"


def _subgroups(rank: int, world_size: int) -> dict[str, Any]:
    group, _ = dist.new_subgroups(2)
    group_rank = dist.get_rank(group)
    case = Case("subgroups", [2, 5], inner=(4, 3, 3), seed=10 + rank // 2)
    return run_case(case, rank, group=group, group_rank=group_rank)


def test_subgroups_normalise_over_their_own_ranks() -> None:
    for rank, errors in enumerate(launch(_subgroups, 4)):
        for key, value in errors.items():
            assert value <= 1e-11, f"rank {rank} {key}: {value}"


def _global_count_one(rank: int, world_size: int) -> str:
    bn = syncbn.SyncBatchNorm(3)
    x = torch.randn(1 if rank == 0 else 0, 3)
    before = copy.deepcopy(bn.state_dict())
    try:
        bn(x)
    except ValueError as exc:
        for k, v in bn.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed"
        return str(exc)
    return "no error"


def test_global_count_of_one_raises_on_every_rank() -> None:
    messages = launch(_global_count_one, 3)
    for msg in messages:
        assert "Expected more than 1 value per channel when training" in msg


def _eval_never_communicates(rank: int, world_size: int) -> bool:
    torch.manual_seed(rank)
    bn = syncbn.SyncBatchNorm2d(4)
    ref = nn.BatchNorm2d(4)
    bn.eval()
    ref.eval()
    if rank == 0:  # rank 1 runs no forward at all: any collective would hang
        for _ in range(3):
            x = torch.randn(5, 4, 3, 3)
            assert torch.equal(bn(x), ref(x))
        bn.track_running_stats = False
        ref.track_running_stats = False
        x = torch.randn(5, 4, 3, 3)
        assert torch.equal(bn(x), ref(x))
    frozen = syncbn.SyncBatchNorm2d(4, freeze=True).train()
    if rank == 1:  # freeze never communicates either
        x = torch.randn(5, 4, 3, 3, requires_grad=True)
        frozen(x).sum().backward()
        assert frozen.weight.grad is None and x.grad is not None
        assert int(frozen.num_batches_tracked) == 0
    # DDP with default settings trains a model holding frozen layers (no gradient is expected of
    # their parameters: requires_grad=False, as torch's way of freezing), over several steps
    from syncbn.compat import megengine

    for frozen_layer in (syncbn.SyncBatchNorm2d(4, freeze=True), megengine.SyncBatchNorm(4, freeze=True)):
        model = nn.Sequential(nn.Conv2d(3, 4, 1), frozen_layer, nn.Conv2d(4, 2, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        for _ in range(3):
            ddp(torch.randn(2, 3, 4, 4)).sum().backward()
        assert not frozen_layer.weight.requires_grad and frozen_layer.weight.grad is None
    return True


def test_eval_and_freeze_never_communicate() -> None:
    assert launch(_eval_never_communicates, 2, timeout=60) == [True, True]


def _collectives(rank: int, world_size: int) -> list[int]:
    group = CountingGroup()
    bn = syncbn.SyncBatchNorm2d(8, process_group=group)
    x = torch.randn(4 + rank, 8, 5, 5, requires_grad=True)
    bn(x).backward(torch.randn_like(x))
    return group.calls


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_collective_each_way_sized_by_channels(world_size: int) -> None:
    for calls in launch(_collectives, world_size):
        assert calls == [2 * 8 + 1, 2 * 8]


def _copy_and_save(rank: int, world_size: int) -> list[float]:
    group, _ = dist.new_subgroups(2)
    bn = syncbn.SyncBatchNorm1d(3, process_group=group).double()
    clone = copy.deepcopy(bn)
    assert clone.process_group is group
    buf = io.BytesIO()
    torch.save(bn, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    errors = []
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    full = torch.cat(
        [torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    )
    base = 2 * (rank // 2)
    ref = nn.BatchNorm1d(3).double()(full[4 * base : 4 * base + 8])[4 * (rank % 2) : 4 * (rank % 2) + 4]
    for module in (bn, clone, loaded):
        errors.append((module(x) - ref).abs().max().item())
    return errors


def test_deepcopy_and_torch_save_keep_an_explicit_group() -> None:
    for errors in launch(_copy_and_save, 4):
        assert max(errors) < 1e-12, errors
