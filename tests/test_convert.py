"""convert_sync_batchnorm / revert_sync_batchnorm: what they keep, what they swap, round trips."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import syncbn
from _helpers.compare import assert_same_step
from _helpers.dist_harness import launch
from syncbn.convert import BatchNorm, ConversionWarning


def _net(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(nn.Conv3d(4, 4, 1), nn.BatchNorm3d(4, momentum=None)),
        nn.Flatten(2),
        nn.BatchNorm1d(4, affine=False),
        nn.Flatten(1),
        nn.Linear(4 * 2 * 3 * 3, 5),
        nn.BatchNorm1d(5, track_running_stats=False),
    )

    # Conv3d needs 5D input: a small adapter module.
    class Unsqueeze(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.unsqueeze(2).expand(-1, -1, 2, -1, -1)

    net.insert(3, Unsqueeze())
    return net.to(dtype)


def _randomise(net: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight is not None:
                    m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=gen))
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                    m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                    m.num_batches_tracked.fill_(7)


X = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def test_convert_swaps_classes_and_keeps_the_very_same_state() -> None:
    net = _net()
    _randomise(net)
    net[1].weight.requires_grad_(False)
    net[1].eval()
    net[1].tag = "mine"
    before = {id(m): m for m in net.modules()}
    params = {n: p for n, p in net.named_parameters()}
    buffers = {n: b for n, b in net.named_buffers()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    out = syncbn.convert_sync_batchnorm(net)

    assert out is net
    kinds = [type(m) for m in out.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [
        syncbn.SyncBatchNorm2d,
        syncbn.SyncBatchNorm3d,
        syncbn.SyncBatchNorm1d,
        syncbn.SyncBatchNorm1d,
    ]
    for n, p in out.named_parameters():
        assert p is params[n], n
    for n, b in out.named_buffers():
        assert b is buffers[n], n
    assert out[1].weight.requires_grad is False and out[1].bias.requires_grad is True
    assert out[1].training is False and out[4][1].training is True
    assert out[1].tag == "mine"
    assert out[4][1].momentum is None
    assert out[6].weight is None and out[6].affine is False
    assert out[9].running_mean is None and out[9].track_running_stats is False
    assert all(p.dtype == torch.float64 for p in out.parameters())
    assert all(id(m) not in before for m in out.modules() if isinstance(m, syncbn.SyncBatchNorm))

    # The optimizer built before conversion trains the converted model.
    loss = out(X).square().sum()
    loss.backward()
    w = out[9].weight.detach().clone()
    opt.step()
    assert not torch.equal(out[9].weight, w)


def test_single_process_converted_model_computes_exactly_what_the_original_did() -> None:
    net = _net()
    _randomise(net)
    ref = copy.deepcopy(net)
    conv = syncbn.convert_sync_batchnorm(net)
    for training in (True, False):
        conv.train(training)
        ref.train(training)
        assert_same_step(conv, ref, X)
    for (k1, v1), (k2, v2) in zip(conv.state_dict().items(), ref.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1


def test_hooks_move_with_the_layer_and_their_handles_still_work() -> None:
    bn = nn.BatchNorm1d(3)
    seen: list[str] = []
    h1 = bn.register_forward_pre_hook(lambda m, i: seen.append("pre"))
    h2 = bn.register_forward_hook(lambda m, i, o: seen.append("post"))
    h3 = bn.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    h4 = bn.register_forward_hook(lambda m, a, k, o: seen.append("kwargs"), with_kwargs=True)
    # Older torch (2.2 among them) has it only as _register_state_dict_hook (same call, same handle).
    register = getattr(bn, "register_state_dict_post_hook", None) or bn._register_state_dict_hook
    h5 = register(lambda *a: seen.append("state_dict"))
    model = nn.Sequential(nn.Linear(2, 3), bn)
    conv = syncbn.convert_sync_batchnorm(model)
    assert isinstance(conv[1], syncbn.SyncBatchNorm1d)
    conv(torch.randn(4, 2)).sum().backward()
    conv.state_dict()
    assert seen == ["pre", "post", "kwargs", "backward", "state_dict"]
    for h in (h1, h2, h3, h4, h5):
        h.remove()
    seen.clear()
    conv(torch.randn(4, 2)).sum().backward()
    conv.state_dict()
    assert seen == []


def test_a_root_batchnorm_is_converted_and_returned() -> None:
    bn = nn.BatchNorm2d(4).double()
    weight = bn.weight
    new = syncbn.convert_sync_batchnorm(bn)
    assert type(new) is syncbn.SyncBatchNorm2d and new.weight is weight
    back = syncbn.revert_sync_batchnorm(new)
    assert type(back) is nn.BatchNorm2d and back.weight is weight
    assert syncbn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(2)).__class__ is syncbn.SyncBatchNorm1d


def test_torch_syncbatchnorm_and_other_batchnorms_become_the_generic_class() -> None:
    sentinel = object()

    class Custom(nn.modules.batchnorm._BatchNorm):
        def _check_input_dim(self, input: torch.Tensor) -> None:
            pass

    class Renamed(nn.BatchNorm2d):  # no behaviour of its own: keeps the 2d checks
        pass

    model = nn.Sequential(nn.SyncBatchNorm(3, process_group=sentinel), Custom(3), Renamed(3))
    conv = syncbn.convert_sync_batchnorm(model)
    assert [type(m) for m in conv] == [syncbn.SyncBatchNorm, syncbn.SyncBatchNorm, syncbn.SyncBatchNorm2d]
    assert conv[0].process_group is sentinel  # kept when no group is given
    other = object()
    conv2 = syncbn.convert_sync_batchnorm(nn.Sequential(nn.SyncBatchNorm(3, process_group=sentinel)), other)
    assert conv2[0].process_group is other
    # torch.nn.SyncBatchNorm reverts to the any-rank plain BatchNorm.
    back = syncbn.revert_sync_batchnorm(nn.Sequential(nn.SyncBatchNorm(3, process_group=sentinel)))
    assert type(back[0]) is BatchNorm and not hasattr(back[0], "process_group")


def test_explicit_group_and_existing_syncbn_layers() -> None:
    group = object()
    keep = syncbn.SyncBatchNorm2d(3)
    model = nn.Sequential(nn.BatchNorm2d(3), keep)
    conv = syncbn.convert_sync_batchnorm(model, process_group=group)
    assert conv[0].process_group is group
    assert conv[1] is keep and keep.process_group is None
    # the in-place synchronised layers take the group, the compat InPlaceABNSync in its ``group``
    from syncbn.compat.inplace_abn import ABN, InPlaceABN, InPlaceABNSync

    in_place = nn.Sequential(syncbn.InPlaceSyncBatchNorm2d(3), InPlaceABNSync(3), InPlaceABN(3), ABN(3))
    syncbn.convert_sync_batchnorm(in_place, process_group=group)
    assert in_place[0].process_group is group and in_place[1].group is group
    assert all(m._group() is None for m in in_place[2:])  # local layers: no group


def test_shared_layers_stay_shared() -> None:
    bn = nn.BatchNorm1d(3)
    model = nn.Sequential(bn, nn.ReLU(), bn)
    conv = syncbn.convert_sync_batchnorm(model)
    assert conv[0] is conv[2] and isinstance(conv[0], syncbn.SyncBatchNorm1d)
    back = syncbn.revert_sync_batchnorm(conv)
    assert back[0] is back[2] and type(back[0]) is nn.BatchNorm1d


def test_uninitialised_lazy_batchnorm_is_a_clear_error_and_initialised_one_converts() -> None:
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"uninitialised LazyBatchNorm2d at '2'.*forward pass"):
        syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d  # an error leaves the model untouched
    assert isinstance(model[2], nn.LazyBatchNorm2d)
    model(torch.randn(2, 3, 4, 4))
    conv = syncbn.convert_sync_batchnorm(model)
    assert type(conv[2]) is syncbn.SyncBatchNorm2d and conv[2].num_features == 4


class BNReLU(nn.BatchNorm2d):
    """A norm-plus-activation layer: behaviour of its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


def test_subclass_with_its_own_forward_is_left_and_named_in_a_warning() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BNReLU(4), nn.BatchNorm2d(4))
    layer = model[1]
    with pytest.warns(ConversionWarning, match=r"'1' \(BNReLU\).*own forward"):
        conv = syncbn.convert_sync_batchnorm(model)
    assert conv[1] is layer
    assert type(conv[2]) is syncbn.SyncBatchNorm2d
    assert (conv[1](torch.randn(2, 4, 3, 3)) >= 0).all()  # still applies its activation

    class SyncBNReLU(syncbn.SyncBatchNorm2d):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return torch.relu(super().forward(input))

    with pytest.warns(ConversionWarning, match="SyncBNReLU"):
        back = syncbn.revert_sync_batchnorm(nn.Sequential(SyncBNReLU(4)))
    assert type(back[0]) is SyncBNReLU


def test_parametrized_layer_is_converted_with_its_parametrization() -> None:
    class Positive(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.abs()

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3).double())
    parametrize.register_parametrization(model[0], "weight", Positive())
    with torch.no_grad():
        model[0].parametrizations.weight.original.copy_(torch.tensor([-2.0, 0.5, -1.0]))
    original = model[0].parametrizations.weight.original
    plist = model[0].parametrizations.weight
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conv = syncbn.convert_sync_batchnorm(model)
    layer = conv[0]
    assert isinstance(layer, syncbn.SyncBatchNorm1d) and parametrize.is_parametrized(layer, "weight")
    assert layer.parametrizations.weight is plist and layer.parametrizations.weight.original is original
    assert list(layer.state_dict()) == list(ref[0].state_dict())
    x = torch.randn(6, 3, dtype=torch.float64)
    g = torch.randn(6, 3, dtype=torch.float64)
    (layer(x) * g).sum().backward()
    (ref(x) * g).sum().backward()
    assert torch.equal(layer.weight, torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.allclose(original.grad, ref[0].parametrizations.weight.original.grad)
    back = syncbn.revert_sync_batchnorm(conv)[0]
    assert type(back).__bases__ == (nn.BatchNorm1d,) and back.parametrizations.weight.original is original
    assert torch.equal(back.eval()(x), ref.eval()(x))


def test_subclasses_revert_to_the_very_same_class() -> None:
    class Renamed(nn.BatchNorm2d):
        def __init__(self, n: int, tag: str) -> None:
            super().__init__(n)
            self.tag = tag

    class AnyRank(nn.modules.batchnorm._BatchNorm):
        def _check_input_dim(self, input: torch.Tensor) -> None:
            pass

    model = nn.Sequential(Renamed(3, "x"), AnyRank(3), nn.BatchNorm2d(3), nn.SyncBatchNorm(3))
    conv = syncbn.convert_sync_batchnorm(model)
    assert [type(m) for m in conv] == [
        syncbn.SyncBatchNorm2d,
        syncbn.SyncBatchNorm,
        syncbn.SyncBatchNorm2d,
        syncbn.SyncBatchNorm,
    ]
    back = syncbn.revert_sync_batchnorm(conv)
    assert [type(m) for m in back] == [Renamed, AnyRank, nn.BatchNorm2d, BatchNorm]
    assert back[0].tag == "x"
    for m in back:
        assert "_syncbn_reverts_to" not in m.__dict__ and not hasattr(m, "process_group")


def test_syncbn_dimension_classes_are_torch_batchnorm_instances() -> None:
    for sync, plain in (
        (syncbn.SyncBatchNorm1d, nn.BatchNorm1d),
        (syncbn.SyncBatchNorm2d, nn.BatchNorm2d),
        (syncbn.SyncBatchNorm3d, nn.BatchNorm3d),
    ):
        layer = sync(4)
        assert isinstance(layer, plain) and isinstance(layer, syncbn.SyncBatchNorm)
        assert list(layer.state_dict()) == list(plain(4).state_dict())
        assert repr(layer).startswith(sync.__name__ + "(4,")
        # syncbn's own input check, not torch's, runs first in the method order
        assert type(layer)._check_input_dim is syncbn.SyncBatchNorm._check_input_dim
        assert type(syncbn.revert_sync_batchnorm(layer)) is plain
    assert not isinstance(syncbn.SyncBatchNorm(4), (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        syncbn.SyncBatchNorm2d(4)(torch.randn(2, 4, 3))


def test_no_warning_for_plain_models() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.revert_sync_batchnorm(syncbn.convert_sync_batchnorm(_net()))


def test_revert_gives_plain_batchnorm_classes() -> None:
    model = nn.Sequential(
        syncbn.SyncBatchNorm1d(3),
        syncbn.SyncBatchNorm2d(3),
        syncbn.SyncBatchNorm3d(3),
        syncbn.SyncBatchNorm(3, freeze=True),
    )
    back = syncbn.revert_sync_batchnorm(model)
    assert [type(m) for m in back] == [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm]
    for m in back:
        assert not hasattr(m, "process_group") and not hasattr(m, "freeze")
    x = torch.randn(4, 3, 2, 2, 2, 2)  # 6D: the generic plain class accepts it
    bn = back[3].eval()
    assert torch.equal(
        bn(x), nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    )
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        back[3](torch.randn(3))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated, still supported
def test_round_trip_is_bit_identical_and_the_result_scripts() -> None:
    net = _net()
    _randomise(net)
    original = copy.deepcopy(net).eval()
    want_state = copy.deepcopy(net.state_dict())
    y_want = original(X)

    back = syncbn.revert_sync_batchnorm(syncbn.convert_sync_batchnorm(net)).eval()
    assert [type(m) for m in back.modules()] == [type(m) for m in original.modules()]
    state = back.state_dict()
    assert list(state) == list(want_state)
    for k, v in want_state.items():
        assert torch.equal(state[k], v) and state[k].dtype == v.dtype, k
    assert torch.equal(back(X), y_want)

    scripted = torch.jit.script(back)
    assert torch.equal(scripted(X), y_want)
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    assert torch.equal(torch.jit.load(buf)(X), y_want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_generic_reverted_class_scripts_and_exports() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), syncbn.SyncBatchNorm(4)).eval()
    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[1]) is BatchNorm
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(torch.jit.script(back)(x), model(x))
    exported = torch.export.export(back, (x,))
    assert torch.equal(exported.module()(x), model(x))
    assert pickle.loads(pickle.dumps(back))[1].__class__ is BatchNorm


@pytest.mark.parametrize(
    "plain, sync, shape",
    [
        (nn.BatchNorm1d, syncbn.SyncBatchNorm1d, (5, 3)),
        (nn.BatchNorm2d, syncbn.SyncBatchNorm2d, (5, 3, 2, 2)),
        (nn.BatchNorm3d, syncbn.SyncBatchNorm3d, (5, 3, 2, 2, 2)),
        (nn.BatchNorm2d, syncbn.SyncBatchNorm, (5, 3, 2, 2)),
        (BatchNorm, syncbn.SyncBatchNorm, (5, 3, 2, 2)),
    ],
)
def test_state_dict_loads_strictly_both_ways(plain: Any, sync: Any, shape: tuple[int, ...]) -> None:
    a = plain(3)
    a.train()(torch.randn(shape) * 3 + 1)
    b = sync(3)
    b.load_state_dict(a.state_dict(), strict=True)
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)
    b(torch.randn(shape))
    c = plain(3)
    c.load_state_dict(b.state_dict(), strict=True)
    for k, v in b.state_dict().items():
        assert torch.equal(c.state_dict()[k], v)


def test_whole_model_checkpoints_load_strictly_both_ways() -> None:
    net = _net()
    _randomise(net)
    conv = syncbn.convert_sync_batchnorm(_net())
    conv.load_state_dict(net.state_dict(), strict=True)
    plain = _net()
    plain.load_state_dict(conv.state_dict(), strict=True)
    for k, v in net.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


HAS_BIAS_FLAG = "bias" in inspect.signature(nn.BatchNorm2d).parameters


@pytest.mark.skipif(not HAS_BIAS_FLAG, reason="nn.BatchNorm*d(bias=False) needs a newer torch")
def test_weight_without_bias_survives_the_round_trip() -> None:
    bn = nn.BatchNorm2d(3, bias=False)  # type: ignore[call-arg]
    conv = syncbn.convert_sync_batchnorm(bn)
    assert conv.bias is None and conv.weight is bn.weight
    assert list(conv.state_dict()) == ["weight", "running_mean", "running_var", "num_batches_tracked"]
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    conv(x).backward(torch.randn(4, 3, 2, 2))
    assert conv.weight.grad is not None
    back = syncbn.revert_sync_batchnorm(conv)
    assert type(back) is nn.BatchNorm2d and back.bias is None and "bias=False" in repr(back)


def test_errors_name_what_was_expected() -> None:
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(got int\)"):
        syncbn.convert_sync_batchnorm(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(got str\)"):
        syncbn.revert_sync_batchnorm("model")  # type: ignore[arg-type]


# ---- under 2 gloo ranks: a converted model trains as the full-batch original ----


def _converted_training(rank: int, world_size: int) -> dict[str, float]:
    net = _net()
    _randomise(net)
    ref = copy.deepcopy(net)
    conv = syncbn.convert_sync_batchnorm(net)
    gen = torch.Generator().manual_seed(5)
    errors: dict[str, float] = {}
    sizes = [3, 5]
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for _ in range(2):
        full = torch.randn(sum(sizes), 3, 3, 3, dtype=torch.float64, generator=gen)
        grad = torch.randn(sum(sizes), 5, dtype=torch.float64, generator=gen)
        x_ref = full.clone().requires_grad_()
        ref.zero_grad()
        ref(x_ref).backward(grad)
        x = full[start:stop].clone().requires_grad_()
        conv.zero_grad()
        y = conv(x)
        y.backward(grad[start:stop])
        errors["grad_input"] = max(
            errors.get("grad_input", 0.0), (x.grad - x_ref.grad[start:stop]).abs().max().item()
        )
        for (name, p), p_ref in zip(conv.named_parameters(), ref.parameters()):
            g = p.grad.clone()
            torch.distributed.all_reduce(g)  # every layer's share, BN weight/bias included, sums up
            errors[name] = max(errors.get(name, 0.0), (g - p_ref.grad).abs().max().item())
    for (k, v), v_ref in zip(conv.state_dict().items(), ref.state_dict().values()):
        errors["state:" + k] = (v.double() - v_ref.double()).abs().max().item()
    back = syncbn.revert_sync_batchnorm(conv).eval()
    errors["reverted_eval"] = (back(full) - ref.eval()(full)).abs().max().item()
    if HAS_BIAS_FLAG:  # a weight without bias synchronises too
        plain = nn.BatchNorm1d(4, bias=False).double()  # type: ignore[call-arg]
        sync = syncbn.convert_sync_batchnorm(copy.deepcopy(plain))
        full = torch.randn(8, 4, dtype=torch.float64, generator=gen)
        x_ref = full.clone().requires_grad_()
        x = full[start:stop].clone().requires_grad_()
        grad = torch.randn(8, 4, dtype=torch.float64, generator=gen)
        y_ref = plain(x_ref)
        y_ref.backward(grad)
        y = sync(x)
        y.backward(grad[start:stop])
        errors["no_bias_output"] = (y - y_ref[start:stop]).abs().max().item()
        errors["no_bias_grad_input"] = (x.grad - x_ref.grad[start:stop]).abs().max().item()
        errors["no_bias_running_var"] = (sync.running_var - plain.running_var).abs().max().item()
    return errors


def test_converted_model_on_two_ranks_equals_the_original_on_the_global_batch() -> None:
    for rank, errors in enumerate(launch(_converted_training, 2, timeout=120)):
        for key, value in errors.items():
            assert value <= 1e-10, f"rank {rank} {key}: {value}"


class _Positive(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs()


def _parametrized_ranks(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3).double()
    parametrize.register_parametrization(ref, "weight", _Positive())
    with torch.no_grad():
        ref.parametrizations.weight.original.copy_(torch.tensor([-2.0, 0.5, -1.0]))
    layer = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    x = torch.randn(10, 3, dtype=torch.float64) * 2 + 1
    g = torch.randn(10, 3, dtype=torch.float64)
    rows = slice(0, 6) if rank == 0 else slice(6, 10)  # uneven shards
    xs = x[rows].clone().requires_grad_()
    y = layer(xs)
    (y * g[rows]).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * g).sum().backward()
    grad = layer.parametrizations.weight.original.grad.clone()
    torch.distributed.all_reduce(grad)
    return {
        "out": float((y - yr[rows]).abs().max()),
        "input_grad": float((xs.grad - xr.grad[rows]).abs().max()),
        "original_grad": float((grad - ref.parametrizations.weight.original.grad).abs().max()),
        "running_var": float((layer.running_var - ref.running_var).abs().max()),
    }


def test_parametrized_layer_trains_synchronised_across_ranks() -> None:
    for result in launch(_parametrized_ranks, 2):
        for key, err in result.items():
            assert err < 1e-12, (key, err)
