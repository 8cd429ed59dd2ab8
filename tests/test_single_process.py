"""Single-process behaviour: the math, gradients, module semantics and errors."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import syncbn
from _helpers.compare import assert_same_step
from syncbn.cli.bench import LoopbackGroup
from syncbn.engine import _math
from syncbn.engine._function import Params, SyncBatchNormFunction

CLASSES = [
    (syncbn.SyncBatchNorm1d, nn.BatchNorm1d, (6, 4)),
    (syncbn.SyncBatchNorm1d, nn.BatchNorm1d, (6, 4, 5)),
    (syncbn.SyncBatchNorm2d, nn.BatchNorm2d, (6, 4, 3, 5)),
    (syncbn.SyncBatchNorm3d, nn.BatchNorm3d, (6, 4, 2, 3, 5)),
    (syncbn.SyncBatchNorm, nn.BatchNorm2d, (6, 4, 3, 5)),
]


class OneMember:
    """The group of a single member: summing over it is the identity."""

    size = 1
    rank = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize("ours_cls, ref_cls, shape", CLASSES)
@pytest.mark.parametrize(
    "kwargs", [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}]
)
def test_without_process_group_is_exactly_batchnorm(ours_cls, ref_cls, shape, kwargs) -> None:
    torch.manual_seed(0)
    ours, ref = ours_cls(4, **kwargs), ref_cls(4, **kwargs)
    ours.load_state_dict(ref.state_dict())
    for training in (True, True, False):
        ours.train(training)
        ref.train(training)
        assert_same_step(ours, ref, torch.randn(shape))
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


@pytest.mark.parametrize("read_count", [True, False], ids=["host-count", "device-count"])
@pytest.mark.parametrize("sizes", [[5], [3, 4], [1, 0, 7, 2], [0, 9, 1]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merging_chunk_moments_equals_full_batch(sizes, dtype, read_count) -> None:
    gen = torch.Generator().manual_seed(1)
    full = (torch.randn(sum(sizes), 3, 4, 4, generator=gen, dtype=torch.float64) * 0.5 + 3).to(dtype)
    packed = torch.zeros(7, dtype=torch.float64)
    for chunk in torch.split(full, sizes):
        n = chunk.numel() // 3
        mean, var = _math.local_moments(chunk) if n else (None, None)
        packed += _math.pack_moments(n, mean, var, channels=3, device=chunk.device)
    # read_count=False takes the accelerator path (the count stays a tensor: no host sync).
    count, (mean, var, unbiased) = _math.unpack_moments(packed, 3, read_count=read_count)
    ref_var, ref_mean = torch.var_mean(full.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    assert isinstance(count, float) is read_count
    assert float(count) == full.numel() // 3
    torch.testing.assert_close(mean, ref_mean, rtol=tol, atol=tol)
    torch.testing.assert_close(var, ref_var, rtol=tol, atol=tol)
    torch.testing.assert_close(unbiased, torch.var(full.double(), dim=(0, 2, 3)), rtol=tol, atol=tol)


def test_local_moments_are_stable_for_large_means() -> None:
    x = torch.randn(32, 4, 16, 16, dtype=torch.float64) * 1e-3 + 10.0  # mean/std = 1e4
    for layout in (x, x.contiguous(memory_format=torch.channels_last), x[:, :, 0, 0]):
        x32 = layout.float()
        mean, var = _math.local_moments(x32)
        ref_var, ref_mean = torch.var_mean(x32.double(), dim=[0, *range(2, x32.dim())], correction=0)
        assert ((var.double() - ref_var).abs() / ref_var).max() < 1e-3


def test_empty_global_batch_gives_zeros_not_nan() -> None:
    count, (mean, var, unbiased) = _math.unpack_moments(torch.zeros(9, dtype=torch.float64), 4)
    assert count == 0
    for t in (mean, var, unbiased):
        assert torch.equal(t, torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 5), (3, 3, 2, 4)])
def test_gradcheck_float64(affine, shape) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(affine)
    b = torch.randn(3, dtype=torch.float64).requires_grad_(affine)
    weight, bias = (w, b) if affine else (None, None)

    def fn(x, *params):
        return SyncBatchNormFunction.apply(
            x, *(params or (None, None)), Params(None, None, 1e-5, 0.1, OneMember())
        )

    assert torch.autograd.gradcheck(fn, (x, *((weight, bias) if affine else ())))


def test_function_with_group_of_one_equals_batch_norm() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    rm2, rv2 = rm.clone(), rv.clone()
    y = SyncBatchNormFunction.apply(x, w, b, Params(rm, rv, 1e-5, 0.1, OneMember()))
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = F.batch_norm(x2, rm2, rv2, w2, b2, True, 0.1, 1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    for a, c in ((y, y2), (x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad), (rm, rm2), (rv, rv2)):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_state_dict_loads_strictly_both_ways() -> None:
    for ours_cls, ref_cls, _ in CLASSES:
        ours, ref = ours_cls(4), ref_cls(4)
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
        ours.load_state_dict(ref.state_dict(), strict=True)
        ref.load_state_dict(ours.state_dict(), strict=True)


def test_constructor_matches_torch_sync_batchnorm() -> None:
    bn = syncbn.SyncBatchNorm(8, 1e-3, 0.2, False, False, None, "cpu", torch.float64, freeze=False)
    assert (bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (1e-3, 0.2, False, False)
    assert bn.process_group is None and bn.weight is None and bn.running_mean is None
    assert syncbn.SyncBatchNorm2d(4, dtype=torch.float64).weight.dtype == torch.float64


def test_freeze_uses_and_keeps_running_stats() -> None:
    torch.manual_seed(0)
    bn = syncbn.SyncBatchNorm2d(4, freeze=True)
    with torch.no_grad():
        bn.running_mean.uniform_()
        bn.running_var.uniform_(0.5, 1.5)
    before = copy.deepcopy(bn.state_dict())
    ref = nn.BatchNorm2d(4).eval()
    ref.load_state_dict(before)
    x = torch.randn(5, 4, 3, 3, requires_grad=True)
    y = bn.train()(x)
    y.backward(torch.randn_like(y))
    assert torch.equal(y, ref(x))
    assert bn.weight.grad is None and bn.bias.grad is None and x.grad is not None
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k])
    assert "freeze=True" in repr(bn)
    with pytest.raises(ValueError, match="track_running_stats"):
        syncbn.SyncBatchNorm(4, track_running_stats=False, freeze=True)


@pytest.mark.parametrize(
    "cls, shape, exc, match",
    [
        (syncbn.SyncBatchNorm, (4,), ValueError, r"expected at least 2D input \(got 1D input\)"),
        (syncbn.SyncBatchNorm1d, (2, 4, 3, 3), ValueError, r"expected 2D or 3D input \(got 4D input\)"),
        (syncbn.SyncBatchNorm2d, (2, 4, 3), ValueError, r"expected 4D input \(got 3D input\)"),
        (syncbn.SyncBatchNorm3d, (2, 4, 3, 3), ValueError, r"expected 5D input \(got 4D input\)"),
        (
            syncbn.SyncBatchNorm2d,
            (2, 5, 3, 3),
            ValueError,
            r"expected input with 4 channels .*got 5 channels",
        ),
    ],
)
def test_bad_input_is_rejected_before_any_state_changes(cls, shape, exc, match) -> None:
    bn = cls(4)
    before = copy.deepcopy(bn.state_dict())
    with pytest.raises(exc, match=match):
        bn(torch.randn(shape))
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k])


def test_non_floating_input_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"expected a floating-point input tensor \(got dtype torch.int64\)"):
        syncbn.SyncBatchNorm2d(4)(torch.ones(2, 4, 3, 3, dtype=torch.long))


def test_single_value_per_channel_raises_like_batchnorm() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        syncbn.SyncBatchNorm1d(4)(torch.randn(1, 4))


def test_module_pickles_and_deepcopies_without_group() -> None:
    bn = syncbn.SyncBatchNorm2d(4)
    bn(torch.randn(3, 4, 2, 2))
    for clone in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        for k, v in bn.state_dict().items():
            assert torch.equal(v, clone.state_dict()[k])
    buf = io.BytesIO()
    torch.save(bn, buf)
    buf.seek(0)
    assert isinstance(torch.load(buf, weights_only=False), syncbn.SyncBatchNorm2d)


def test_functional_without_group_is_functional_batch_norm() -> None:
    x = torch.randn(5, 3, 4)
    rm1, rv1, rm2, rv2 = torch.zeros(3), torch.ones(3), torch.zeros(3), torch.ones(3)
    y1 = syncbn.functional.sync_batch_norm(x, rm1, rv1, training=True, momentum=0.3)
    y2 = F.batch_norm(x, rm2, rv2, training=True, momentum=0.3)
    assert torch.equal(y1, y2) and torch.equal(rm1, rm2) and torch.equal(rv1, rv2)
    with pytest.raises(ValueError, match="expected input with 3 channels"):
        syncbn.functional.sync_batch_norm(torch.randn(5, 4), rm1, rv1, training=True)
    before = rm1.clone()
    for bad in ("running_var", "weight", "bias"):  # every per-channel tensor is checked, nothing changes
        args = {"running_var": rv1, "weight": torch.ones(3), "bias": torch.zeros(3), bad: torch.ones(4)}
        with pytest.raises(ValueError, match=f"expected {bad} with 3 elements, one per channel .*got 4"):
            syncbn.functional.sync_batch_norm(x, rm1, training=True, **args)
    assert torch.equal(rm1, before)


def test_low_precision_input_to_float32_layer_keeps_input_dtype() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        y = syncbn.SyncBatchNorm2d(4)(torch.randn(3, 4, 2, 2).to(dtype))
        assert y.dtype == dtype


def test_bias_false_matches_batchnorm_without_bias() -> None:
    torch.manual_seed(0)
    ours = syncbn.SyncBatchNorm2d(4, bias=False)
    assert ours.bias is None and ours.weight is not None
    assert "bias" not in ours.state_dict()
    if "bias" in inspect.signature(nn.BatchNorm2d.__init__).parameters:
        ref = nn.BatchNorm2d(4, bias=False)
    else:  # torch < 2.13: what its bias=False makes, by hand
        ref = nn.BatchNorm2d(4)
        ref.register_parameter("bias", None)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(5, 4, 3, 3)
    assert torch.equal(ours(x), ref(x))
    ours.reset_parameters()
    assert ours.bias is None and torch.equal(ours.weight, torch.ones(4))


def test_bias_false_through_the_synchronised_function() -> None:
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        return SyncBatchNormFunction.apply(x, w, None, Params(None, None, 1e-5, 0.1, OneMember()))

    assert torch.autograd.gradcheck(fn, (x, w))


def test_input_grad_takes_the_count_as_a_float_or_a_device_tensor() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(6, 4, 3, generator=gen, dtype=torch.float64)
    weight = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    sums = torch.stack(_math.backward_sums(g, x, weight, mean, var, 1e-5))
    host = _math.input_grad(g, x, weight, _math.Stats(mean, var, 1e-5, 18.0, 18), sums)
    on_device = _math.Stats(mean, var, 1e-5, torch.tensor(18.0, dtype=torch.float64), 18)
    device = _math.input_grad(g, x, weight, on_device, sums)
    torch.testing.assert_close(host, device, rtol=1e-15, atol=1e-15)
    xr = x.clone().requires_grad_()
    F.batch_norm(xr, None, None, weight, None, True, 0.0, 1e-5).backward(g)
    torch.testing.assert_close(host, xr.grad, rtol=1e-12, atol=1e-12)


def test_shared_empty_and_one_tensors_are_never_written() -> None:
    layer = syncbn.SyncBatchNorm(3, process_group=LoopbackGroup())
    for dtype in (torch.float32, torch.float64):
        for shape in [(4, 3, 5), (8, 3, 64, 64)]:  # the native-statistics path and the scratch path
            layer.to(dtype)(torch.randn(shape, dtype=dtype)).sum().backward()
    assert all(t.numel() == 0 for t in _math._EMPTY.values())
    assert all(t.tolist() == [1.0] for t in _math._ONES.values())


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (3, 3, 4, 4), (40, 3, 100, 100)])
def test_accelerator_flow_on_cpu_matches_batchnorm(monkeypatch: pytest.MonkeyPatch, shape) -> None:
    """The flow CUDA takes (no host reads: the count stays a tensor; a fresh output), run on CPU."""
    from syncbn.engine import _function

    monkeypatch.setattr(_function, "_host_side", lambda x: False)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    ours = syncbn.SyncBatchNorm(3, process_group=LoopbackGroup()).double()
    ref = nn.BatchNorm1d(3).double() if len(shape) < 4 else nn.BatchNorm2d(3).double()
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(xs).backward(dy)
    ref(xr).backward(dy)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-10, atol=1e-10)
    for a, b in [(ours.weight.grad, ref.weight.grad), (ours.running_var, ref.running_var)]:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ours(torch.randn(1, 3, dtype=torch.float64))


def test_a_wrong_channel_count_is_the_runtime_error_torch_raises_and_a_value_error() -> None:
    """Code written against ``nn.BatchNorm``/``F.batch_norm`` catches ``RuntimeError`` for it."""
    from syncbn.compat.inplace_abn import inplace_abn

    with pytest.raises(RuntimeError):  # torch's own type, which syncbn's error must also be
        nn.BatchNorm2d(3)(torch.randn(2, 4, 2, 2))
    x, three = torch.randn(2, 4, 2, 2), torch.ones(3)
    calls = {
        "functional input": lambda: syncbn.functional.sync_batch_norm(x, three, three, training=True),
        "functional weight": lambda: syncbn.functional.sync_batch_norm(x, None, None, torch.ones(4), three),
        "layer, training": lambda: syncbn.SyncBatchNorm2d(3)(x),
        "layer, eval": lambda: syncbn.SyncBatchNorm2d(3).eval()(x),
        "renorm layer": lambda: syncbn.SyncBatchRenorm2d(3)(x),
        "in-place layer": lambda: syncbn.InPlaceSyncBatchNorm(3)(x.clone()),
        "in-place functional": lambda: inplace_abn(x.clone(), three, three, three, three, True),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="channel|elements") as caught:
            call()
        assert isinstance(caught.value, ValueError), name
