"""``syncbn.accumulation``: one exact running-statistics update over k micro-batches of W ranks.

The reference for each layer is ``nn.BatchNorm`` (float64) run once on the concatenation of the
inputs that layer saw in all k micro-batches of all ranks, starting from the same statistics.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import _helpers.compiling  # noqa: F401  (the compiler's modules, inherited by the forked ranks)
import syncbn
from _helpers.dist_harness import launch
from _helpers.marks import HAS_COMPILED_OPS, needs_compiled_ops
from syncbn import _accumulating, groups

pytestmark = pytest.mark.timeout(180)

TOL = 1e-12
C1, C2 = 4, 5


def _plain(seed: int = 0, momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, C1, 3, padding=1),
        nn.BatchNorm2d(C1, momentum=momentum),
        nn.Conv2d(C1, C2, 1),
        nn.BatchNorm2d(C2, momentum=momentum),
    ).double()
    with torch.no_grad():
        for layer in (model[1], model[3]):
            layer.running_mean.uniform_(-1, 1)
            layer.running_var.uniform_(0.5, 2)
            layer.num_batches_tracked.fill_(3)
            layer.weight.uniform_(0.5, 1.5)
    return model


def _ours(plain: nn.Sequential, inplace: bool | str) -> nn.Sequential:
    """The plain model with syncbn layers (the last one in-place when ``inplace``, Batch
    Renormalization when it is ``"renorm"``)."""
    model = syncbn.convert_sync_batchnorm(copy.deepcopy(plain))
    if inplace == "renorm":
        last = plain[3]
        renorm = syncbn.SyncBatchRenorm2d(C2, momentum=last.momentum, r_max=1.5, d_max=0.4).double()
        renorm.load_state_dict(last.state_dict())
        model[3] = renorm  # last: its (r, d) change no other layer's input; its statistics are BN's
    elif inplace:
        last = plain[3]
        layer = syncbn.InPlaceSyncBatchNorm2d(C2, momentum=last.momentum, activation="identity").double()
        layer.load_state_dict(last.state_dict())
        model[3] = layer  # last: its own (|w| + eps) scale changes no other layer's input
    return model


def _expected(plain: nn.Sequential, micro: list[Tensor]) -> list[dict[str, Tensor]]:
    """Each BN layer's state after one forward on the concatenation of its k micro-batch inputs."""
    seen: dict[int, list[Tensor]] = {1: [], 3: []}
    ref = copy.deepcopy(plain)
    hooks = [ref[i].register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach())) for i in seen]
    for x in micro:  # each micro-batch normalised on its own, as in the block
        ref(x)
    for h in hooks:
        h.remove()
    out = []
    for i, inputs in seen.items():
        bn = copy.deepcopy(plain[i])
        bn(torch.cat(inputs))
        out.append({k: v.clone() for k, v in bn.state_dict().items()})
    return out


def _error(model: nn.Module, expected: list[dict[str, Tensor]]) -> float:
    worst = 0.0
    for layer, state in zip((model[1], model[3]), expected):
        assert int(layer.num_batches_tracked) == int(state["num_batches_tracked"])
        for key in ("running_mean", "running_var"):
            worst = max(worst, (getattr(layer, key) - state[key]).abs().max().item())
    return worst


def _data(seed: int, sizes: list[list[int]]) -> list[list[Tensor]]:
    """``sizes[m][r]`` samples for micro-batch m on rank r, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) * 2 + 1 for n in row] for row in sizes
    ]


# --- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("inplace", [False, True, "renorm"])
def test_single_process_matches_the_concatenated_batch(momentum: float | None, inplace: bool | str) -> None:
    plain = _plain(momentum=momentum)
    model = _ours(plain, inplace)
    micro = [b[0] for b in _data(1, [[3], [2], [5]])]
    with syncbn.accumulation(model):
        for x in micro:
            model(x).square().mean().backward()
    assert _error(model, _expected(plain, micro)) < TOL


def test_renorm_limits_changed_inside_the_block_count_each_micro_batch_once() -> None:
    # A renorm layer without a group takes batch norm's local path at r_max=1, d_max=0 (seen by
    # the block's hooks) and the engine otherwise (which reports the moments): asked per call.
    torch.manual_seed(0)
    micro = [torch.randn(6, 3, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    ref = nn.BatchNorm1d(3).double()
    ref(torch.cat(micro))
    warm, relaxed = (1.0, 0.0), (3.0, 5.0)
    schedules = [
        (warm, [relaxed] * 3),
        (relaxed, [warm] * 3),
        (warm, [warm, relaxed, warm]),
        (relaxed, [relaxed, warm, relaxed]),
        (relaxed, [relaxed] * 3),
    ]
    for start, limits in schedules:
        layer = syncbn.SyncBatchRenorm1d(3, r_max=start[0], d_max=start[1]).double()
        with syncbn.accumulation(layer):
            for (r_max, d_max), x in zip(limits, micro):
                layer.r_max, layer.d_max = r_max, d_max
                layer(x)
        assert int(layer.num_batches_tracked) == 1, (start, limits)
        for key in ("running_mean", "running_var"):
            error = (getattr(layer, key) - getattr(ref, key)).abs().max().item()
            assert error < TOL, (start, limits, key, error)


def test_plain_batchnorm_and_masked_input() -> None:
    bn = nn.BatchNorm1d(3).double()
    ours = syncbn.SyncBatchNorm(3).double()
    xs = [torch.randn(n, 3, 6, dtype=torch.float64) + 3 for n in (2, 4)]
    masks = [torch.rand(n, 6) > 0.4 for n in (2, 4)]
    with syncbn.accumulation(bn), syncbn.accumulation(ours):
        for x, mask in zip(xs, masks):
            bn(x)
            ours(x, mask)
    ref = nn.BatchNorm1d(3).double()
    ref(torch.cat(xs))
    assert torch.allclose(bn.running_var, ref.running_var, atol=TOL, rtol=0)
    valid = torch.cat([x.movedim(1, -1)[m] for x, m in zip(xs, masks)])  # (M, C)
    ref = nn.BatchNorm1d(3).double()
    ref(valid)
    assert torch.allclose(ours.running_mean, ref.running_mean, atol=TOL, rtol=0)
    assert torch.allclose(ours.running_var, ref.running_var, atol=TOL, rtol=0)
    assert int(ours.num_batches_tracked) == 1

    # momentum=None without a num_batches_tracked: nn.BatchNorm's factor is 0, nothing changes
    for layer in (nn.BatchNorm1d(3, momentum=None), syncbn.SyncBatchNorm1d(3, momentum=None)):
        layer.num_batches_tracked = None
        ref = copy.deepcopy(layer)
        with syncbn.accumulation(layer):
            for x in xs:
                layer(x.float())
        ref(torch.cat(xs).float())
        assert torch.equal(layer.running_mean, ref.running_mean), type(layer)
        assert torch.equal(layer.running_var, ref.running_var), type(layer)


@needs_compiled_ops
def test_compiled_single_process() -> None:
    for inplace in (False, True, "renorm"):
        plain = _plain()
        model = _ours(plain, inplace)
        counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd, as inductor sees it
        compiled = torch.compile(model, backend=counter)
        micro = [b[0] for b in _data(3, [[3], [3]])]
        ref = copy.deepcopy(plain)
        for _ in range(2):
            with syncbn.accumulation(model):
                for x in micro:
                    compiled(x).square().mean().backward()
            for i, state in zip((1, 3), _expected(ref, micro)):
                ref[i].load_state_dict(state)
        assert _error(model, [ref[1].state_dict(), ref[3].state_dict()]) < TOL
        assert counter.frame_count == 1


@pytest.mark.parametrize("chunks", [2, 1])
@pytest.mark.parametrize("inplace", [False, True])
def test_data_parallel_replicas(inplace: bool, chunks: int) -> None:
    # syncbn.parallel.data_parallel: the CPU code path of nn.DataParallel (replica 0 updates the
    # original buffers with the replicas' joint statistics; the block sees them once). One chunk:
    # one replica (nn.DataParallel given a batch smaller than its devices), torch's kernel path.
    plain = _plain()
    model = _ours(plain, inplace)
    micro = [b[0] for b in _data(4, [[4], [6], [2]])]
    with syncbn.accumulation(model):
        for x in micro:
            syncbn.parallel.data_parallel(model, x, chunks=chunks).square().mean().backward()
    assert _error(model, _expected(plain, micro)) < TOL


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_forwards_count_once(reentrant: bool) -> None:
    # The recomputation inside backward is not a new micro-batch.
    from torch.utils.checkpoint import checkpoint

    plain = _plain()
    model = _ours(plain, inplace=False)
    micro = [b[0] for b in _data(5, [[3], [4]])]
    with syncbn.accumulation(model):
        for x in micro:
            x = x.clone().requires_grad_()
            checkpoint(model, x, use_reentrant=reentrant).square().mean().backward()
    assert _error(model, _expected(plain, micro)) < TOL


def test_an_exception_leaves_the_statistics_as_before() -> None:
    model = _ours(_plain(), inplace=True)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(KeyError):
        with syncbn.accumulation(model):
            model(torch.randn(4, 3, 4, 4, dtype=torch.float64))
            raise KeyError("stop")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_eval_forwards_and_no_forward_change_nothing() -> None:
    model = _ours(_plain(), inplace=False)
    before = copy.deepcopy(model.state_dict())
    with syncbn.accumulation(model):
        pass
    model.eval()
    with syncbn.accumulation(model):
        model(torch.randn(2, 3, 4, 4, dtype=torch.float64))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_manual_begin_commit_and_errors() -> None:
    plain = _plain()
    model = _ours(plain, inplace=False)
    micro = [b[0] for b in _data(2, [[2], [3]])]
    block = syncbn.accumulation(model)
    for _ in range(2):  # the same object serves every optimizer step
        block.begin()
        assert block.active
        for x in micro:
            model(x)
        block.commit()
        assert not block.active
    ref = copy.deepcopy(plain)
    for _ in range(2):  # the second step starts from the first one's statistics
        for i, state in zip((1, 3), _expected(ref, micro)):
            ref[i].load_state_dict(state)
    assert _error(model, [ref[1].state_dict(), ref[3].state_dict()]) < TOL
    with pytest.raises(RuntimeError, match="expected begin"):
        block.commit()
    with syncbn.accumulation(model):
        with pytest.raises(RuntimeError, match="nested"):
            syncbn.accumulation(model).begin()
    refused = nn.Sequential(syncbn.SyncBatchNorm(3), nn.SyncBatchNorm(3))
    with pytest.raises(TypeError, match="torch.nn.SyncBatchNorm"):
        syncbn.accumulation(refused).begin()
    with syncbn.accumulation(refused[0]):  # the refusal left no layer listening
        pass
    assert not _accumulating._listeners
    with pytest.raises(TypeError, match="expected an nn.Module"):
        syncbn.accumulation("model")  # type: ignore[arg-type]


# --- W gloo ranks -----------------------------------------------------------------------------

SIZES = [[2, 3, 1], [4, 0, 2], [1, 1, 3]]  # micro-batch m, rank r (uneven; an empty rank)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    calls = {"n": 0}
    original = groups.ProcessGroupSum.all_reduce_sum
    original_bounded = groups.ProcessGroupSum.all_reduce_sum_bounded

    def counting(self: Any, tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls["n"] += 1
        return original(self, tensor, *args, **kwargs)

    def counting_bounded(self: Any, tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls["n"] += 1
        return original_bounded(self, tensor, *args, **kwargs)

    groups.ProcessGroupSum.all_reduce_sum = counting  # type: ignore[method-assign]
    groups.ProcessGroupSum.all_reduce_sum_bounded = counting_bounded  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    data = _data(7, SIZES)
    for momentum in (0.1, None):
        for inplace in (False, True, "renorm"):
            plain = _plain(momentum=momentum)
            expected = _expected(plain, [torch.cat(row) for row in data])
            # without the block: k updates, and the number of collectives to compare with
            model = _ours(plain, inplace)
            calls["n"] = 0
            for row in data:
                model(row[rank]).square().mean().backward()
            without = calls["n"]
            model = _ours(plain, inplace)
            calls["n"] = 0
            with syncbn.accumulation(model):
                for row in data:
                    grad = torch.randn_like(row[rank])
                    model(row[rank]).backward(grad[:, :1].expand(-1, C2, -1, -1).contiguous())
            # one collective more: the ranks' vote at the block's end
            result[f"plain m={momentum} inplace={inplace}"] = (
                _error(model, expected),
                calls["n"] - without - 1,
            )
    # checkpointed (recomputed in backward: not a new micro-batch)
    plain = _plain()
    expected = _expected(plain, [torch.cat(row) for row in data])
    model = _ours(plain, inplace=False)
    with syncbn.accumulation(model):
        for row in data:
            x = row[rank].clone().requires_grad_()
            torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).square().mean().backward()
    result["checkpoint"] = (_error(model, expected), 0)

    # DDP with no_sync for all but the last micro-batch (no empty rank: DDP needs a graph)
    sizes = [[2, 3, 1], [4, 1, 2], [1, 2, 3]]
    data = _data(8, sizes)
    plain = _plain()
    expected = _expected(plain, [torch.cat(row) for row in data])
    for compiled in (False, True) if HAS_COMPILED_OPS else (False,):  # (compile: see test_compile.py)
        ddp = nn.parallel.DistributedDataParallel(_ours(plain, inplace=True))
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        with syncbn.accumulation(ddp):
            for m, row in enumerate(data):
                if m < len(data) - 1:
                    with ddp.no_sync():
                        run(row[rank]).square().mean().backward()
                else:
                    run(row[rank]).square().mean().backward()
        result[f"ddp no_sync compiled={compiled}"] = (_error(ddp.module, expected), 0)

    # torch.compile: the traced layers show their moments too (no graph break, no recompilation)
    sizes = [[2, 3, 1]] * 3
    data = _data(9, sizes)
    for inplace in (False, True) if HAS_COMPILED_OPS else ():
        plain = _plain()
        model = _ours(plain, inplace)
        counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd, as inductor sees it
        compiled = torch.compile(model, backend=counter)
        ref = copy.deepcopy(plain)
        for _ in range(2):
            with syncbn.accumulation(model):
                for row in data:
                    compiled(row[rank]).square().mean().backward()
            for i, state in zip((1, 3), _expected(ref, [torch.cat(row) for row in data])):
                ref[i].load_state_dict(state)
        error = _error(model, [ref[1].state_dict(), ref[3].state_dict()])
        result[f"compiled inplace={inplace}"] = (error, counter.frame_count - 1)

    # an exception inside the block, on every rank: the statistics as before
    model = _ours(_plain(), inplace=True)
    before = copy.deepcopy(model.state_dict())
    try:
        with syncbn.accumulation(model):
            model(data[0][rank])
            raise ValueError("stop")
    except ValueError:
        pass
    result["exception"] = (max((v - before[k]).abs().max().item() for k, v in model.state_dict().items()), 0)
    dist.barrier()
    return result


@pytest.mark.timeout(600)  # above the launch's own deadline, 150 s stretched by the load (x3 at most)
def test_ranks_match_the_concatenated_micro_batches_with_one_vote_per_block() -> None:
    results = launch(_ranks, 3, timeout=150)
    for rank, result in enumerate(results):
        for case, (error, extra) in result.items():
            assert error < TOL, (rank, case, error)
            assert extra == 0, (rank, case, f"{extra} extra collectives beyond the vote (or compiled frames)")
    assert results[0] == results[1] == results[2]


def _states(*layers: nn.Module) -> list[dict[str, Tensor]]:
    return [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]


def _disagreeing(rank: int, world: int) -> dict[str, Any]:
    """Ranks that end a block differently (an exception or discard() on one rank, uneven micro-batch
    counts under Join): every rank applies the same update, or every rank puts its statistics back."""
    import warnings

    from torch.distributed.algorithms import Join

    syncbn.set_timeout(10.0)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(11)
    micro = [
        [torch.randn(3 + r, 4, generator=gen, dtype=torch.float64) * 2 + 1 for r in range(world)]
        for _ in range(3)
    ]
    bn = syncbn.SyncBatchNorm1d(4).double()
    before = _states(bn)

    def outcome(error: BaseException | None) -> tuple[Any, ...]:
        kept = all(torch.equal(v, before[0][k]) for k, v in bn.state_dict().items())
        mismatch = getattr(error, "mismatch", None)
        return (None if error is None else type(error).__name__, mismatch, kept)

    # rank 0 raises after the block's last collective (a loss check): every rank discards
    error: BaseException | None = None
    try:
        with syncbn.accumulation(bn):
            for row in micro:
                bn(row[rank])
            if rank == 0:
                raise KeyError("skip this step")
    except KeyError as exc:
        error = exc
    out["raise after the collectives"] = outcome(error)

    # rank 0 raises while the others still call the layer: their call meets rank 0's vote and
    # raises a mismatch there, then they vote too; every rank discards, the group stays usable
    error = None
    try:
        with syncbn.accumulation(bn):
            bn(micro[0][rank])
            if rank == 0:
                raise KeyError("skip this step")
            bn(micro[1][rank])
    except (KeyError, syncbn.CollectiveError) as exc:
        error = exc
    out["raise between the collectives"] = outcome(error)

    # by hand: discard() on rank 0, commit() on the others
    block = syncbn.accumulation(bn).begin()
    bn(micro[0][rank])
    block.discard() if rank == 0 else block.commit()
    out["discard on one rank"] = outcome(None)

    # then a block that every rank commits: the one exact update over every rank's micro-batches
    with syncbn.accumulation(bn):
        for row in micro:
            bn(row[rank])
    ref = nn.BatchNorm1d(4).double()
    ref(torch.cat([x for row in micro for x in row]))
    out["commit after"] = _states(bn) + [
        max((bn.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    ]

    # nn.DataParallel replicas under a process group synchronise within the process only (warned);
    # a block leaves what the plain call leaves on each rank, with no vote on those moments
    x = torch.randn(4 + 2 * rank, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    plain, blocked = syncbn.SyncBatchNorm1d(4).double(), syncbn.SyncBatchNorm1d(4).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        syncbn.parallel.data_parallel(plain, x, chunks=2)
        with syncbn.accumulation(blocked):
            syncbn.parallel.data_parallel(blocked, x, chunks=2)
    local = nn.BatchNorm1d(4).double()
    local(x)
    out["replicas"] = (
        max((blocked.state_dict()[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
        max((local.state_dict()[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
        sum("replicas synchronise with each other only" in str(w.message) for w in caught),
    )

    # Join inside the block with uneven micro-batch counts (rank r: 2 + r): the rank that joined
    # early did not see the calls it shadowed; every rank takes the moments of the last one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4)).double()
    ref = copy.deepcopy(model[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", groups.UnboundedStepWarning)
        ddp = nn.parallel.DistributedDataParallel(model)
        joinable = syncbn.JoinableSyncBatchNorm(ddp)
        data = [
            [torch.randn(4, 3, generator=gen, dtype=torch.float64) + i for i in range(2 + r)]
            for r in range(world)
        ]
        with syncbn.accumulation(ddp):
            with Join([joinable, ddp]):
                for x in data[rank]:
                    ddp(x).square().mean().backward()
    with torch.no_grad():
        inputs = torch.cat([model[0](x) for xs in data for x in xs])
    nn.BatchNorm1d.forward(ref, inputs)
    out["join"] = _states(model[1]) + [
        max((model[1].state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    ]
    dist.barrier()

    # last (the group is unusable after): rank 0 commits a block that rank 1 never closes; the
    # vote waits the bound, raises, and rank 0's statistics are put back
    syncbn.set_timeout(2.0)
    if rank == 0:
        before = _states(bn)
        error = None
        block = syncbn.accumulation(bn).begin()
        with torch.no_grad():
            bn.running_mean.add_(1.0)  # as a forward would have
        try:
            block.commit()
        except syncbn.CollectiveError as exc:
            error = exc
            block.discard()  # a training loop's except clause: nothing left to do, nothing raised
        out["peer never closes"] = (outcome(error), "syncbn.accumulation" in str(error), block.active)
        with pytest.raises(RuntimeError, match="expected begin"):
            block.discard()  # only the first discard after the failure is a no-op
    return out


def test_ranks_that_end_a_block_differently_agree() -> None:
    results = launch(_disagreeing, 2, timeout=150)
    first, second = results
    # discarded on every rank, each rank's own exception raised as it was
    assert first["raise after the collectives"] == ("KeyError", None, True)
    assert second["raise after the collectives"] == (None, None, True)
    assert first["raise between the collectives"] == ("KeyError", None, True)
    assert second["raise between the collectives"] == ("CollectiveError", True, True)
    assert first["discard on one rank"] == second["discard on one rank"] == (None, None, True)
    for replicas in (first["replicas"], second["replicas"]):
        assert replicas[0] < TOL and replicas[1] < TOL and replicas[2] >= 1, replicas
    assert first["peer never closes"] == (("CollectiveError", False, True), True, False)
    for case in ("commit after", "join"):
        *state0, error0 = first[case]
        *state1, error1 = second[case]
        assert error0 < TOL and error1 < TOL, (case, error0, error1)
        assert all(torch.equal(state0[0][k], state1[0][k]) for k in state0[0]), case
        assert int(state0[0]["num_batches_tracked"]) == 1, case


def _two_groups(rank: int, world: int, subgroup_first: bool) -> tuple[int, int]:
    sub = syncbn.SyncBatchNorm1d(3, process_group=groups.subgroup(2))
    whole = syncbn.SyncBatchNorm1d(3)
    model = nn.Sequential(sub, whole) if subgroup_first else nn.Sequential(whole, sub)
    try:
        with syncbn.accumulation(model):
            for _ in range(2):
                model(torch.randn(4, 3))
            if rank == 0:
                raise KeyError("this rank skips the step")
    except KeyError:
        pass
    return int(sub.num_batches_tracked), int(whole.num_batches_tracked)


@pytest.mark.parametrize("subgroup_first", [True, False], ids=["subgroup-first", "default-first"])
def test_a_discard_in_any_group_puts_back_every_layer_of_the_ranks_that_see_it(subgroup_first: bool) -> None:
    # Ranks 2 and 3 share the default group's vote with rank 0, which raised: none of their layers
    # may commit, whichever group votes first (the pair's own vote agreed to commit).
    results = launch(_two_groups, 4, subgroup_first, timeout=150)
    assert results == [(0, 0)] * 4, results
