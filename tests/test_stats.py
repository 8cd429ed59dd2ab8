"""sync_running_stats and recompute_running_stats: exact merges, identical on every rank.

References are computed in float64 from the data itself: the mean and variance of
the concatenation of everything that reached each BatchNorm layer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import syncbn
from _helpers.dist_harness import launch
from syncbn import groups

F64 = torch.float64


def _net(norm: Any = nn.BatchNorm2d, norm1d: Any = nn.BatchNorm1d) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        norm(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        norm1d(5),
        nn.Dropout(0.0),
    ).double()


def _batches(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 4, 4, generator=g, dtype=F64) * 3 + 2 for n in sizes]


def _layer_inputs(
    model: nn.Module,
    steps: list[torch.Tensor],
    kind: type | tuple[type, ...] = nn.modules.batchnorm._BatchNorm,
) -> list[torch.Tensor]:
    """Every ``kind`` layer's inputs over the given forward batches (train mode, on a copy of the
    model: the in-place layers write over them), as (M, C) each."""
    model = copy.deepcopy(model).train()
    layers = [m for m in model.modules() if isinstance(m, kind)]
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [
        layer.register_forward_pre_hook(
            lambda mod, args, i=i: seen[i].append(
                args[0].detach().movedim(1, -1).reshape(-1, args[0].shape[1])
            )
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for x in steps:
            model(x)
    for h in handles:
        h.remove()
    return [torch.cat(s) for s in seen]


def _bn(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_recompute_single_process_gives_population_statistics_and_restores_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = _net()
    batches = _batches(1, [5, 3, 8, 2])
    expected = _layer_inputs(model, batches)
    model.eval()
    model[6].train()  # a mixed-mode model comes back in its modes
    before_tracked = [int(m.num_batches_tracked) for m in _bn(model)]
    assert syncbn.recompute_running_stats(model, batches, progress=True) is model
    for layer, values in zip(_bn(model), expected):
        torch.testing.assert_close(layer.running_mean, values.mean(0), rtol=0, atol=1e-13)
        torch.testing.assert_close(layer.running_var, values.var(0), rtol=0, atol=1e-12)
        # not what an average of per-batch variances gives
    assert [m.training for m in model.modules()] == [False] * 7 + [True]
    assert [int(m.num_batches_tracked) for m in _bn(model)] == before_tracked
    captured = capsys.readouterr()
    assert captured.out == "" and "4/4 batches" in captured.err  # the progress bar: stderr only
    syncbn.recompute_running_stats(model, iter(batches), progress=False)  # no len(): fine
    assert capsys.readouterr().err == ""

    # a DataLoader of an IterableDataset: its __len__ raises TypeError; the bar counts without a total
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(torch.cat(batches))

    for progress in (False, True):
        loader = torch.utils.data.DataLoader(Stream(), batch_size=6)
        syncbn.recompute_running_stats(model, loader, progress=progress)
        first = _bn(model)[0]  # the first layer's inputs do not depend on how the data are batched
        torch.testing.assert_close(first.running_var, expected[0].var(0), rtol=0, atol=1e-12)
    assert "syncbn.recompute_running_stats: 3 batches" in capsys.readouterr().err


def test_recompute_differs_from_averaging_batch_variances() -> None:
    model = _net()
    batches = _batches(2, [4, 4, 4])
    syncbn.recompute_running_stats(model, batches, progress=False)
    inputs = _layer_inputs(_net(), batches)[0].reshape(3, -1, 4)  # (batch, positions, C)
    averaged = inputs.var(1).mean(0)  # what averaging per-batch statistics gives
    exact = inputs.reshape(-1, 4).var(0)
    torch.testing.assert_close(_bn(model)[0].running_var, exact, rtol=0, atol=1e-12)
    assert (exact - averaged).abs().max() > 1e-3


def test_recompute_masked_calls_unreached_and_frozen_layers() -> None:
    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = syncbn.SyncBatchNorm1d(3).double()
            self.unused = nn.BatchNorm1d(3).double()
            self.frozen = syncbn.SyncBatchNorm1d(3, freeze=True).double()

        def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, mask = batch
            return self.frozen(self.bn(x, mask=mask))

    model = Seq()
    with torch.no_grad():
        model.frozen.running_var.fill_(2.0)
    g = torch.Generator().manual_seed(5)
    batches = []
    for n, lengths in ((2, [6, 2]), (3, [1, 6, 4])):
        x = torch.randn(n, 3, 6, generator=g, dtype=F64) + 4
        batches.append((x, torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]))
    syncbn.recompute_running_stats(model, batches, progress=False)
    valid = torch.cat([x.movedim(1, -1)[m] for x, m in batches])
    torch.testing.assert_close(model.bn.running_mean, valid.mean(0), rtol=0, atol=1e-13)
    torch.testing.assert_close(model.bn.running_var, valid.var(0), rtol=0, atol=1e-12)
    assert torch.equal(model.unused.running_mean, torch.zeros(3, dtype=F64))  # never reached: kept
    assert torch.equal(model.frozen.running_var, torch.full((3,), 2.0, dtype=F64))  # frozen: kept


def test_recompute_covers_the_in_place_layers_and_never_writes_over_the_batches() -> None:
    from syncbn._abn_layer import ActivatedBatchNormBase
    from syncbn.compat.inplace_abn import ABN, InPlaceABN

    torch.manual_seed(6)
    model = nn.Sequential(
        syncbn.InPlaceSyncBatchNorm2d(3, activation="leaky_relu"),
        nn.Conv2d(3, 4, 1),
        InPlaceABN(4, activation="elu"),
        ABN(4),
    ).double()
    layers = [model[0], model[2], model[3]]
    with torch.no_grad():
        for layer in layers:
            layer.weight.uniform_(0.5, 2.0)
            layer.num_batches_tracked.fill_(7)
    g = torch.Generator().manual_seed(7)
    # (input, label) pairs; the model sees a view of the input (its first 3 of 5 channels)
    batches = [(torch.randn(n, 5, 3, 3, generator=g, dtype=F64) * 2 + 1, torch.zeros(n)) for n in (4, 2, 5)]
    originals = [x.clone() for x, _ in batches]

    seen = _layer_inputs(model, [x[:, :3].clone() for x, _ in batches], ActivatedBatchNormBase)

    model.eval()
    syncbn.recompute_running_stats(model, batches, forward=lambda m, b: m(b[0][:, :3]), progress=False)
    assert len(seen) == len(layers)
    for layer, everything in zip(layers, seen):
        torch.testing.assert_close(layer.running_mean, everything.mean(0), rtol=0, atol=1e-13)
        torch.testing.assert_close(layer.running_var, everything.var(0), rtol=0, atol=1e-12)
        assert int(layer.num_batches_tracked) == 7
    assert all(torch.equal(x, original) for (x, _), original in zip(batches, originals))
    assert not any(m.training for m in model.modules())  # back in eval mode


def test_recompute_error_leaves_the_statistics_and_modes() -> None:
    model = _net().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [*_batches(3, [4, 4]), torch.randn(4, 7, 4, 4, dtype=F64)]  # the last has the wrong channels
    with pytest.raises(RuntimeError):
        syncbn.recompute_running_stats(model, batches, progress=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m.training for m in model.modules())
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(got list\)"):
        syncbn.recompute_running_stats([], batches)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(got int\)"):
        syncbn.sync_running_stats(3)  # type: ignore[arg-type]


def test_sync_running_stats_is_a_no_op_in_one_process() -> None:
    model = _net()
    model(_batches(4, [6])[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert syncbn.sync_running_stats(model) is model
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _stats_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    calls = []
    original = groups.ProcessGroupSum.all_reduce_sum

    def counted(self: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(tensor.numel())
        return original(self, tensor, *args, **kwargs)

    groups.ProcessGroupSum.all_reduce_sum = counted  # type: ignore[method-assign]

    # 1. sync_running_stats: each rank's statistics describe its own data exactly (biased variance,
    #    num_batches_tracked = its sample count): the merge is the statistics of all the data together.
    g = torch.Generator().manual_seed(11)
    data = [
        [torch.randn(n, c, generator=g, dtype=F64) * (1 + r) + 3 * r for r, n in enumerate((7, 3))]
        for c in (4, 6)
    ]
    model = nn.Sequential(nn.BatchNorm1d(4), syncbn.SyncBatchNorm1d(6)).double()
    for layer, per_rank in zip(model, data):
        mine = per_rank[rank]
        with torch.no_grad():
            layer.running_mean.copy_(mine.mean(0))
            layer.running_var.copy_(mine.var(0, unbiased=False))
            layer.num_batches_tracked.fill_(mine.shape[0])
    calls.clear()
    syncbn.sync_running_stats(model)
    out["sync_calls"] = len(calls)
    err = 0.0
    for layer, per_rank in zip(model, data):
        everything = torch.cat(per_rank)
        err = max(err, float((layer.running_mean - everything.mean(0)).abs().max()))
        err = max(err, float((layer.running_var - everything.var(0, unbiased=False)).abs().max()))
    out["sync_err"] = err
    out["sync_state"] = {k: v.clone() for k, v in model.state_dict().items()}

    # 2. no batches seen anywhere: the ranks weigh equally
    fresh = nn.BatchNorm1d(2).double()
    with torch.no_grad():
        fresh.running_mean.fill_(float(rank))
        fresh.running_var.fill_(1.0)
    syncbn.sync_running_stats(fresh)
    out["equal_weights"] = (fresh.running_mean.tolist(), fresh.running_var.tolist())

    # 3. the ranks' models differ: a ValueError on every rank, nothing changed
    odd = nn.ModuleDict(
        {"a": nn.BatchNorm1d(2), "b": nn.BatchNorm1d(2)}
        if rank == 0
        else {"b": nn.BatchNorm1d(2), "c": nn.BatchNorm1d(2)}
    )
    try:
        syncbn.sync_running_stats(odd)
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    # ... of different total sizes: the transport's mismatch, named for the tool, on every rank
    odd_sizes = nn.Sequential(nn.BatchNorm1d(2 + rank)).double()
    before = [b.clone() for b in odd_sizes.buffers()]
    out["size_mismatch"] = []
    for tool in ("sync", "recompute"):
        try:
            if tool == "sync":
                syncbn.sync_running_stats(odd_sizes)
            else:
                syncbn.recompute_running_stats(odd_sizes, [torch.randn(4, 2 + rank, dtype=F64)])
            out["size_mismatch"].append(("no error",))
        except syncbn.CollectiveError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, odd_sizes.buffers()))
            out["size_mismatch"].append((exc.mismatch, unchanged, str(exc)))

    # 4. recompute with plain BatchNorm: uneven batch counts and sizes per rank
    sizes = ([5, 3, 6], [2, 7])
    batches = [_batches(20 + r, s) for r, s in enumerate(sizes)]
    plain = _net()
    expected = _layer_inputs(plain, [b for per_rank in batches for b in per_rank])  # each batch on its own
    calls.clear()
    syncbn.recompute_running_stats(plain, batches[rank], progress=False)
    out["recompute_calls"] = len(calls)
    out["plain_err"] = max(
        max(float((m.running_mean - v.mean(0)).abs().max()), float((m.running_var - v.var(0)).abs().max()))
        for m, v in zip(_bn(plain), expected)
    )
    out["plain_state"] = {k: v.clone() for k, v in plain.state_dict().items()}

    # 5. recompute with syncbn: the same number of batches per rank; step i normalises over all ranks
    sizes = ([4, 1, 6], [3, 5, 2])
    batches = [_batches(30 + r, s) for r, s in enumerate(sizes)]
    synced = syncbn.convert_sync_batchnorm(_net())
    steps = [torch.cat([batches[0][i], batches[1][i]]) for i in range(3)]
    expected = _layer_inputs(_net(), steps)
    syncbn.recompute_running_stats(synced, batches[rank], progress=False)
    out["sync_bn_err"] = max(
        max(float((m.running_mean - v.mean(0)).abs().max()), float((m.running_var - v.var(0)).abs().max()))
        for m, v in zip(_bn(synced), expected)
    )
    out["sync_bn_state"] = {k: v.clone() for k, v in synced.state_dict().items()}
    groups.ProcessGroupSum.all_reduce_sum = original  # type: ignore[method-assign]

    # 6. the in-place layers take part in sync_running_stats and sync_buffers
    from syncbn.compat.inplace_abn import InPlaceABNSync

    in_place = nn.Sequential(syncbn.InPlaceSyncBatchNorm2d(3), InPlaceABNSync(2)).double()
    for layer in in_place:
        with torch.no_grad():
            layer.running_mean.fill_(float(rank))
            layer.running_var.fill_(1.0 + rank)
            layer.num_batches_tracked.fill_(1 + 2 * rank)  # weights 1 and 3
    syncbn.sync_running_stats(in_place)
    out["in_place_sync"] = [(m.running_mean.tolist(), m.running_var.tolist()) for m in in_place]
    with torch.no_grad():
        for layer in in_place:
            for buf in layer.buffers():
                buf.fill_(10 * rank + 2)
    synced_count = syncbn.sync_buffers(in_place, src=1)
    out["in_place_buffers"] = (synced_count, [float(v) for b in in_place.buffers() for v in b.reshape(-1)])

    # 7. sync_buffers, models of equal total size but different layouts: an error on every rank
    layout = nn.Sequential(nn.BatchNorm1d(2), nn.BatchNorm1d(4))
    if rank == 1:
        layout = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(2))
    with torch.no_grad():
        for buf in layout.buffers():
            buf.fill_(rank + 5)
    before = [b.clone() for b in layout.buffers()]
    try:
        syncbn.sync_buffers(layout)
        out["layout"] = ("no error",)
    except syncbn.CollectiveError as exc:
        out["layout"] = (exc.mismatch, str(exc))
    out["layout_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, layout.buffers()))
    out["layout_then"] = syncbn.sync_buffers(nn.Sequential(nn.BatchNorm1d(2)))  # the group still works

    # 8. sync_running_stats on BatchNorm's unbiased variances of n values per rank: the documented
    #    difference (B - (R - 1) A) / (R n - 1) from the unbiased variance of all values
    values = torch.tensor([[0.0, 2.0, 7.0], [4.0, 6.0, 5.0]], dtype=F64)  # (rank, n = 3)
    bn = nn.BatchNorm1d(1).double()
    with torch.no_grad():
        bn.running_mean.fill_(float(values[rank].mean()))
        bn.running_var.fill_(float(values[rank].var()))
        bn.num_batches_tracked.fill_(1)
    syncbn.sync_running_stats(bn)
    within, between = float(values.var(1).mean()), float(values.mean(1).var(unbiased=False))
    documented = float(values.var()) - (between - within) / (values.numel() - 1)
    out["unbiased_merge"] = (float(bn.running_var), documented, within + between)
    return out


def test_stats_tools_across_ranks_are_exact_and_identical_on_every_rank() -> None:
    results = launch(_stats_ranks, 2)
    for out in results:
        assert out["sync_calls"] == 1  # one all_reduce for the whole model
        assert out["sync_err"] < 1e-12
        assert out["equal_weights"] == ([0.5, 0.5], [1.25, 1.25])  # within 1 + between 0.25
        assert "hold different BatchNorm layers" in out["mismatch"]
        for name, (mismatch, unchanged, message) in zip(("sync", "recompute"), out["size_mismatch"]):
            assert mismatch and unchanged, message
            assert message.startswith(f"syncbn.{name}_running_stats: the ranks' calls differ"), message
            assert "expected the same BatchNorm layers, names and channel counts" in message
        assert out["recompute_calls"] == 2
        assert out["plain_err"] < 1e-12 and out["sync_bn_err"] < 1e-12
        # in-place layers: weights 1 and 3, means 0 and 1, variances 1 and 2
        assert out["in_place_sync"] == [([0.75] * c, [1.75 + 0.1875] * c) for c in (3, 2)], out[
            "in_place_sync"
        ]
        synced_count, buffers = out["in_place_buffers"]
        assert synced_count == 6 and buffers == [12.0] * 12, buffers  # rank 1's
        mismatch, message = out["layout"]
        assert mismatch is True and "syncbn.sync_buffers: the ranks' calls differ" in message, message
        assert "expected the same normalisation layers" in message and "14 values" in message
        assert out["layout_unchanged"] and out["layout_then"] == 3
        merged, documented, mixture = out["unbiased_merge"]
        assert abs(merged - documented) < 1e-12 and abs(merged - mixture) < 1e-12
    for key in ("sync_state", "plain_state", "sync_bn_state"):
        a, b = results[0][key], results[1][key]
        assert all(torch.equal(a[k], b[k]) for k in a), key  # bit-identical on every rank
