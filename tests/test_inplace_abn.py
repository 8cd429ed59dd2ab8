"""In-place activated batch norm in one process: the math, the layers and the inplace-abn API.

Reference: float64 ``nn.BatchNorm`` with weight ``|w| + eps``, then the activation, with random
upstream gradients (see ``_abn_reference``).
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import syncbn
from _helpers.abn_reference import max_error, reference
from _helpers.marks import needs_compiled_ops
from _helpers.modules import Scale
from syncbn.compat import inplace_abn as compat
from syncbn.compat.inplace_abn import ABN, InPlaceABN, InPlaceABNSync, inplace_abn, inplace_abn_sync

pytestmark = pytest.mark.timeout(120)

ACTIVATIONS = [("leaky_relu", 0.01), ("leaky_relu", 0.3), ("elu", 1.0), ("elu", 0.5), ("identity", 0.0)]


def _params(channels: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(channels, generator=gen, dtype=torch.float64) * 1.5 + 0.2
    w[::2] = -w[::2]  # negative weights: scale |w| + eps, gradient sign -1
    return w, torch.randn(channels, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("activation,param", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(6, 3), (3, 4, 3, 5), (2, 3, 2, 3, 2)])
def test_function_matches_batchnorm_then_activation(
    activation: str, param: float, shape: tuple[int, ...]
) -> None:
    channels = shape[1]
    w, b = _params(channels, 1)
    gen = torch.Generator().manual_seed(2)
    rm = torch.randn(channels, generator=gen, dtype=torch.float64)
    rv = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
    for training in (True, False):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 1
        grad = torch.randn(shape, generator=gen, dtype=torch.float64)
        ref = reference(x, grad, w, b, (rm, rv), training=training, activation=activation, param=param)
        leaf = x.clone().requires_grad_()
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        h = leaf * 1.0
        y = inplace_abn(h, wl, bl, rm, rv, training, 0.1, 1e-5, activation, param)
        assert y is h and y._version > 0
        y.backward(grad)
        for got, want in (
            (y, "y"),
            (leaf.grad, "dx"),
            (wl.grad, "dw"),
            (bl.grad, "db"),
            (rm, "rm"),
            (rv, "rv"),
        ):
            assert max_error(got, ref[want]) < 1e-12, (want, training)


@pytest.mark.parametrize(
    "kwargs", [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}]
)
@pytest.mark.parametrize("cls", [InPlaceABN, InPlaceABNSync, syncbn.InPlaceSyncBatchNorm])
def test_layers_train_and_eval_like_the_reference(cls: type, kwargs: dict) -> None:
    layer = cls(4, activation="elu", activation_param=0.8, **kwargs).double()
    ref_bn = nn.BatchNorm2d(4, **kwargs).double()
    if layer.weight is not None:
        w, b = _params(4, 3)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
            ref_bn.weight.copy_(w.abs() + 1e-5)
            ref_bn.bias.copy_(b)
    gen = torch.Generator().manual_seed(4)
    for training in (True, True, False, True, False):
        layer.train(training)
        ref_bn.train(training)
        x = torch.randn(5, 4, 3, 3, generator=gen, dtype=torch.float64) * 3 - 2
        grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = layer(leaf * 1.0)
        y_ref = F.elu(ref_bn(ref_leaf), 0.8)
        y.backward(grad)
        y_ref.backward(grad)
        assert max_error(y, y_ref) < 1e-12
        assert max_error(leaf.grad, ref_leaf.grad) < 1e-12
        if layer.weight is not None:
            assert max_error(layer.bias.grad, ref_bn.bias.grad) < 1e-12
            sign = torch.where(layer.weight < 0, -1.0, 1.0).double()
            assert max_error(layer.weight.grad, ref_bn.weight.grad * sign) < 1e-12
            layer.zero_grad()
            ref_bn.zero_grad()
        for mine, theirs in zip(layer.buffers(), ref_bn.buffers()):
            assert max_error(mine, theirs) < 1e-12


def test_sync_layer_without_a_group_is_exactly_the_local_layer() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5)
    a, b, c = InPlaceABN(6), InPlaceABNSync(6), syncbn.InPlaceSyncBatchNorm2d(6)
    outs = [m(x.clone()) for m in (a, b, c)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(a.running_var, b.running_var) and torch.equal(a.running_var, c.running_var)


def test_abn_is_batchnorm_with_the_plain_weight_then_the_activation() -> None:
    for activation in ("relu", "leaky_relu", "elu", "identity"):
        layer = ABN(3, activation=activation, activation_param=0.2).double()
        ref_bn = nn.BatchNorm1d(3).double()
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([-1.0, 0.5, 2.0]))
            ref_bn.weight.copy_(layer.weight)
        x = torch.randn(6, 3, 4, dtype=torch.float64)
        act = {"relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, 0.2), "elu": lambda t: F.elu(t, 0.2)}
        expected = act.get(activation, lambda t: t)(ref_bn(x))
        assert torch.allclose(layer(x), expected, atol=1e-13)
        assert not x.isnan().any() and torch.equal(layer.running_mean, ref_bn.running_mean)


def test_the_package_api() -> None:
    # Constructors and defaults as inplace-abn 1.1.0.
    base = [
        "num_features",
        "eps",
        "momentum",
        "affine",
        "track_running_stats",
        "activation",
        "activation_param",
    ]
    defaults = [inspect.Parameter.empty, 1e-5, 0.1, True, True, "leaky_relu", 0.01]
    for cls, extra in ((ABN, []), (InPlaceABN, []), (InPlaceABNSync, [("group", None)])):
        params = inspect.signature(cls).parameters
        assert list(params) == base + [n for n, _ in extra]
        assert [p.default for p in params.values()] == defaults + [d for _, d in extra]
    fn_params = ["x", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    fn_params += ["activation", "activation_param"]
    assert list(inspect.signature(inplace_abn).parameters) == fn_params
    assert list(inspect.signature(inplace_abn_sync).parameters) == fn_params + ["group"]
    assert set(compat.__all__) == {"ABN", "InPlaceABN", "InPlaceABNSync", "inplace_abn", "inplace_abn_sync"}
    assert issubclass(InPlaceABN, ABN) and issubclass(InPlaceABNSync, ABN)

    layer = InPlaceABNSync(8)
    for name, value in [("num_features", 8), ("eps", 1e-5), ("momentum", 0.1), ("affine", True)]:
        assert getattr(layer, name) == value
    assert (layer.track_running_stats, layer.activation, layer.activation_param, layer.group) == (
        True,
        "leaky_relu",
        0.01,
        None,
    )
    assert list(layer.state_dict()) == list(nn.BatchNorm2d(8).state_dict())
    assert (
        repr(layer) == "InPlaceABNSync(8, eps=1e-05, momentum=0.1, affine=True, activation=leaky_relu[0.01])"
    )
    assert repr(ABN(4, activation="relu")) == "ABN(4, eps=1e-05, momentum=0.1, affine=True, activation=relu)"
    marker = object()
    layer.set_group(marker)
    assert layer.group is marker
    assert torch.equal(layer.weight, torch.ones(8)) and torch.equal(layer.bias, torch.zeros(8))
    for none in ("weight", "bias"):
        assert getattr(InPlaceABN(3, affine=False), none) is None
    assert InPlaceABN(3, track_running_stats=False).num_batches_tracked is None


def test_relu_and_bad_activations_are_refused_by_the_in_place_classes() -> None:
    for make in (
        lambda: InPlaceABN(4, activation="relu"),
        lambda: InPlaceABNSync(4, activation="relu"),
        lambda: syncbn.InPlaceSyncBatchNorm(4, activation="relu"),
        lambda: inplace_abn(torch.randn(4, 4), None, None, None, None, activation="relu"),
    ):
        with pytest.raises(ValueError, match="ReLU maps every negative value to 0"):
            make()
    with pytest.raises(ValueError, match="expected activation one of"):
        InPlaceABN(4, activation="gelu")
    with pytest.raises(ValueError, match="positive, finite activation_param"):
        InPlaceABN(4, activation="leaky_relu", activation_param=0.0)
    with pytest.raises(ValueError, match="expected activation one of"):
        ABN(4, activation="tanh")


def test_version_1_checkpoints_load() -> None:
    old = nn.BatchNorm2d(5)
    with torch.no_grad():
        old.running_mean.uniform_()
        old.weight.uniform_(0.5, 1.0)
    state = old.state_dict()
    del state["num_batches_tracked"]
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    for cls in (ABN, InPlaceABN, InPlaceABNSync, syncbn.InPlaceSyncBatchNorm2d):
        layer = cls(5)
        layer.num_batches_tracked.fill_(7)
        layer.load_state_dict(state)
        assert int(layer.num_batches_tracked) == 0
        assert torch.equal(layer.running_mean, old.running_mean) and torch.equal(layer.weight, old.weight)
    # Version 2 without the key is an error, as for nn.BatchNorm.
    state._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        InPlaceABN(5).load_state_dict(state)


def test_global_count_one_and_empty_batches() -> None:
    layer = InPlaceABN(3)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        layer(torch.randn(1, 3) * 1.0)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="single sample per channel"):
        inplace_abn(torch.randn(1, 3, 1), None, None, None, None)
    empty = torch.randn(0, 3, 4, requires_grad=True)
    y = layer(empty * 1.0)
    y.sum().backward()
    assert y.shape == (0, 3, 4) and empty.grad.shape == (0, 3, 4)
    assert torch.equal(layer.running_mean, before["running_mean"])


def test_a_leaf_that_requires_grad_is_refused_before_anything_changes() -> None:
    layer = InPlaceABN(3)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="overwrites its input, which here is a leaf"):
        layer(x)
    assert int(layer.num_batches_tracked) == 0 and torch.equal(layer.running_mean, torch.zeros(3))


LAYOUTS = {  # views of a (4, 8, 3, 5) tensor holding the layer's 4 channels
    "channel-strided view": lambda t: t[:, ::2],
    "channel slice": lambda t: t[:, 2:6],
    "batch-strided view": lambda t: t.repeat(2, 1, 1, 1)[::2, 2:6],
    "permuted": lambda t: t[:, 2:6].transpose(2, 3).contiguous().transpose(2, 3),
    "channels_last": lambda t: t[:, 2:6].contiguous(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cls", [syncbn.InPlaceSyncBatchNorm2d, InPlaceABN, InPlaceABNSync])
def test_any_input_layout_matches_the_contiguous_input_on_the_local_path(cls: type, layout: str) -> None:
    # torch's CPU kernel written over a non-contiguous, non-channels-last input reads values it
    # already overwrote: the local path gave a wrong output and wrong running statistics there.
    torch.manual_seed(0)
    base = torch.randn(4, 8, 3, 5, dtype=torch.float64) * 2.0 + 1.0
    grad = torch.randn(4, 4, 3, 5, dtype=torch.float64)
    w, b = _params(4, 1)
    results = []
    for contiguous in (True, False):
        layer = cls(4, activation="leaky_relu", activation_param=0.1).double()
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        leaf = base.clone().requires_grad_()
        h = LAYOUTS[layout](leaf * 1.0)
        if contiguous:
            h = h.contiguous()
        y = layer(h)
        assert y is h
        y.backward(grad)
        results.append((y.detach(), leaf.grad, layer.weight.grad, layer.running_mean, layer.running_var))
    for mine, contiguous_result in zip(results[1], results[0]):
        assert torch.allclose(mine, contiguous_result, rtol=0, atol=1e-12)
    running = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    x = LAYOUTS[layout](base).contiguous()
    ref = reference(x, grad, w, b, running, momentum=0.1, activation="leaky_relu", param=0.1)
    y, _, _, running_mean, running_var = results[1]
    assert (
        max(max_error(y, ref["y"]), max_error(running_mean, ref["rm"]), max_error(running_var, ref["rv"]))
        < 1e-12
    )


@pytest.mark.parametrize("training", [True, False])
def test_an_expanded_input_is_refused_before_anything_changes(training: bool) -> None:
    # Several elements in one memory location cannot each hold an output value.
    for layer in (syncbn.InPlaceSyncBatchNorm2d(4), InPlaceABN(4), InPlaceABNSync(4)):
        layer.train(training)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        x = torch.randn(2, 4, 1, 3).expand(2, 4, 3, 3)
        with pytest.raises(
            RuntimeError, match=r"several elements in one memory location \(size \[2, 4, 3, 3\]"
        ):
            layer(x)
        assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    running = (torch.zeros(4), torch.ones(4))
    with pytest.raises(RuntimeError, match="several elements in one memory location"):
        inplace_abn(torch.randn(4, 1).expand(4, 4), None, None, *running, training)
    assert torch.equal(running[0], torch.zeros(4)) and torch.equal(running[1], torch.ones(4))


@pytest.mark.parametrize(
    "attr,value,match",
    [
        ("activation", "bogus", "expected activation one of"),
        ("activation", "relu", "ReLU maps every negative value to 0"),
        ("activation_param", -1.0, "positive, finite activation_param"),
        ("activation_param", 0.0, "positive, finite activation_param"),
        ("activation_param", float("nan"), "positive, finite activation_param"),
        ("activation_param", None, "positive, finite activation_param"),
    ],
)
@pytest.mark.parametrize("training", [True, False])
def test_activation_set_after_construction_is_checked_at_every_forward(
    attr: str, value: object, match: str, training: bool
) -> None:
    for cls in (syncbn.InPlaceSyncBatchNorm2d, InPlaceABN, InPlaceABNSync):
        layer = cls(4).train(training)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        setattr(layer, attr, value)
        x = torch.randn(3, 4, 2, 2)
        h = x.clone()
        with pytest.raises(ValueError, match=match):
            layer(h)
        assert torch.equal(h, x), "the input is not written"
        assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    abn = ABN(4)
    abn.activation = "tanh"
    with pytest.raises(ValueError, match="expected activation one of"):
        abn(torch.randn(3, 4))
    assert int(abn.num_batches_tracked) == 0
    abn.activation = "relu"  # the non-in-place layer computes ReLU
    assert (abn(torch.randn(3, 4)) >= 0).all()


def test_an_activation_changed_to_a_valid_one_is_used() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    changed = syncbn.InPlaceSyncBatchNorm(3, activation="leaky_relu").double()
    changed.activation, changed.activation_param = "elu", 0.5
    fresh = syncbn.InPlaceSyncBatchNorm(3, activation="elu", activation_param=0.5).double()
    assert torch.equal(changed(x.clone()), fresh(x.clone()))
    assert torch.equal(changed.running_var, fresh.running_var)


def test_double_backward_is_a_clear_error() -> None:
    layer = InPlaceABN(3).double()
    x = torch.randn(5, 3, 2, dtype=torch.float64, requires_grad=True)
    y = layer(x * 2.0)
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=False)
    assert g.shape == x.shape
    y = layer(x * 2.0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)


def _saved_storages(fn) -> dict[int, int]:
    """Storage pointer -> bytes of every tensor saved for backward while ``fn`` runs (each storage once)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_the_in_place_family_runs_the_engine_functions() -> None:
    """One set of autograd Functions for every family: the in-place layers have no Function of their own."""
    model = nn.Sequential(Scale(4), InPlaceABNSync(4, activation="elu", activation_param=0.5)).double()
    x = torch.randn(6, 4, 3, dtype=torch.double)
    assert type(model(x).grad_fn).__name__ == "SyncBatchNormFunctionBackward"
    model.eval()
    assert type(model(x).grad_fn).__name__ == "SyncBatchNormFunctionBackward"
    model.train()
    y = syncbn.parallel.data_parallel(model, x, [4, 2])
    assert type(y.grad_fn).__name__ == "CatBackward0"
    assert {type(e[0]).__name__ for e in y.grad_fn.next_functions} == {"_JointBatchNormBackward"}


@pytest.mark.parametrize("activation", ["leaky_relu", "elu", "identity"])
def test_backward_keeps_only_the_output(activation: str) -> None:
    conv = nn.Conv2d(3, 8, 3)
    x = torch.randn(4, 3, 12, 12)
    h = conv(x)
    abn = InPlaceABNSync(8, activation=activation, activation_param=1.0)
    saved = _saved_storages(lambda: abn(h))
    assert saved == {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes()}
    # The standard pair keeps the BN input and the activation output (two activation-sized buffers).
    bn, act = nn.BatchNorm2d(8), nn.LeakyReLU(inplace=True)
    h2 = conv(x)
    pair = _saved_storages(lambda: act(bn(h2)))
    big = [n for n in pair.values() if n >= h2.untyped_storage().nbytes()]
    assert len(big) == 2


def test_compat_layer_data_parallel_replicas_match_the_whole_batch(short_replica_timeout: float) -> None:
    """The inplace-abn drop-in under DataParallel (the native layer is in ``test_family_matrix.py``)."""
    layer = InPlaceABNSync(4, activation="elu", activation_param=0.6)
    model = nn.Sequential(Scale(4), layer).double()
    w, b = _params(4, 5)
    with torch.no_grad():
        model[1].weight.copy_(w)
        model[1].bias.copy_(b)
    gen = torch.Generator().manual_seed(6)
    running = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    for chunks in ([3, 4], [2, 0, 5], 3):
        x = torch.randn(7, 4, 5, generator=gen, dtype=torch.float64) + 1
        grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        scale = model[0].weight.detach().view(1, -1, 1)
        ref = reference(
            x * scale, grad, w, b, running, activation=layer.activation, param=layer.activation_param
        )
        running = (ref["rm"], ref["rv"])
        leaf = x.clone().requires_grad_()
        model.zero_grad()
        y = syncbn.parallel.data_parallel(model, leaf, chunks)
        y.backward(grad)
        assert max_error(y, ref["y"]) < 1e-12
        assert max_error(leaf.grad, ref["dx"] * scale) < 1e-12
        assert max_error(model[1].weight.grad, ref["dw"]) < 1e-12
        assert max_error(model[1].bias.grad, ref["db"]) < 1e-12
        assert max_error(model[1].running_var, ref["rv"]) < 1e-12
    assert int(model[1].num_batches_tracked) == 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)

    def make() -> nn.Sequential:  # ABN: not in place, the same bookkeeping (momentum=None: cumulative)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3), InPlaceABNSync(6), nn.Conv2d(6, 4, 1), InPlaceABN(4, activation="identity"),
            ABN(4, momentum=None),
        )  # fmt: skip

    block, plain = make(), make()
    plain.load_state_dict(block.state_dict())
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    xp = x.detach().clone().requires_grad_()
    y = checkpoint(block, x, use_reentrant=reentrant)
    yp = plain(xp)
    g = torch.randn_like(y)
    y.backward(g)
    yp.backward(g)
    assert torch.allclose(y, yp) and torch.allclose(x.grad, xp.grad, atol=1e-6)
    for p, q in zip(block.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)
    for p, q in zip(block.buffers(), plain.buffers()):
        assert torch.equal(p, q)  # updated once, not again by the recomputation
    # A region that starts with the in-place layer would recompute from its overwritten input.
    layer = InPlaceABN(6)
    h = torch.randn(4, 6, 3, requires_grad=True) * 1.0
    out = checkpoint(layer, h, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="overwrote in the first forward|modified by an inplace operation"):
        out.sum().backward()


def test_autocast_bfloat16() -> None:
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Conv2d(3, 8, 3), InPlaceABNSync(8), nn.Conv2d(8, 4, 1))
    ref = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(0.01), nn.Conv2d(8, 4, 1))
    with torch.no_grad():
        for a, b in ((ours[0], ref[0]), (ours[2], ref[3])):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
        ref[1].weight.fill_(1.0 + 1e-5)
    x = torch.randn(4, 3, 10, 10)
    grads = []
    for model in (ours, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        assert y.dtype == torch.bfloat16
        y.float().backward(torch.ones_like(y, dtype=torch.float32))
        grads.append((y.float(), model[0].weight.grad.clone()))
    assert (grads[0][0] - grads[1][0]).abs().max() < 0.1
    rel = (grads[0][1] - grads[1][1]).norm() / grads[1][1].norm()
    assert rel < 0.05
    assert torch.allclose(ours[1].running_mean, ref[1].running_mean, atol=0.02)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
def test_low_precision_inputs(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(7)
    w, b = _params(6, 8)
    layer = InPlaceABN(6, activation="leaky_relu", activation_param=0.1)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    x = (torch.randn(4, 6, 8, 8, generator=gen, dtype=torch.float64) * 2 + 1).to(dtype)
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
    ref = reference(x, grad, w, b, None, activation="leaky_relu", param=0.1)
    leaf = x.clone().requires_grad_()
    y = layer(leaf * 1)
    y.backward(grad)
    assert y.dtype == dtype and leaf.grad.dtype == dtype
    assert max_error(y, ref["y"]) < tol
    assert max_error(leaf.grad, ref["dx"]) < tol * 4
    assert max_error(layer.weight.grad, ref["dw"]) / max(1.0, float(ref["dw"].abs().max())) < tol * 4


@needs_compiled_ops
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compiled_fullgraph_under_no_grad_equals_eager(training: bool) -> None:
    # Inference under torch.no_grad(): dynamo traces ctx.mark_dirty only with grad on, so the
    # traced forward runs without the autograd Function there (it raised Unsupported before).
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv1d(3, 4, 1), syncbn.InPlaceSyncBatchNorm(4, activation="elu"))
        model[1].running_mean.uniform_(-1.0, 1.0)
        return model.double().train(training)

    model, ref = make(), make()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for step in range(2):
        x = torch.randn(5, 3, 6, dtype=torch.float64)
        with torch.no_grad():
            y, y_ref = compiled(x), ref(x)
        assert max_error(y, y_ref) <= 1e-12, step
        for p, q in zip(model.state_dict().values(), ref.state_dict().values()):
            assert max_error(p, q) <= 1e-12, step
    assert int(model[1].num_batches_tracked) == (2 if training else 0)
    torch._dynamo.reset()


@needs_compiled_ops
def test_compiled_local_layers_trace_without_graph_breaks() -> None:
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3),
            InPlaceABN(6),
            nn.Conv2d(6, 4, 1),
            syncbn.InPlaceSyncBatchNorm2d(4, activation="elu", activation_param=1.0, momentum=None),
        )

    model, ref = make(), make()
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 3, 8, 8)
    for _ in range(2):
        y, y_ref = compiled(x), ref(x)
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g)
        assert torch.allclose(y, y_ref, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    for p, q in zip(model.buffers(), ref.buffers()):
        assert torch.allclose(p.double(), q.double(), atol=1e-6)
    assert backend.frame_count == 1 and not counters["graph_break"]
    torch._dynamo.reset()


@needs_compiled_ops
@pytest.mark.parametrize("training", [True, False])
def test_compiled_layer_on_a_view_input_matches_eager(training: bool) -> None:
    # The traced Function returns the statistics with the output it writes over x; autograd refuses
    # that for a view input, which dynamo reported as an InternalTorchDynamoError. Now the layer
    # runs eagerly there (a graph break, with a warning); in eval the traced form returns x alone.
    torch.manual_seed(0)
    layers = [
        syncbn.InPlaceSyncBatchNorm2d(4, activation="elu", activation_param=0.5).double() for _ in range(2)
    ]
    for layer in layers:
        layer.train(training)
        with torch.no_grad():
            layer.running_var.fill_(2.0)
    base = torch.randn(8, 8, 3, 3, dtype=torch.float64)
    grad = torch.randn(8, 4, 3, 3, dtype=torch.float64)

    def step(t: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        h = t * 1.0
        return layer(h[:, ::2]), h

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")
    results = []
    for fn, layer in ((compiled, layers[0]), (step, layers[1])):
        leaf = base.clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y, h = fn(leaf, layer)
        y.backward(grad)
        views = [w for w in caught if "view of another tensor" in str(w.message)]
        assert bool(views) == (training and fn is compiled)
        results.append((y, h, leaf.grad, layer.weight.grad, layer.running_mean, layer.running_var))
        assert int(layer.num_batches_tracked) == int(training)
    for mine, eager in zip(*results):
        assert torch.allclose(mine, eager, rtol=0, atol=1e-12)
    torch._dynamo.reset()


@needs_compiled_ops
def test_compiled_layer_refuses_an_expanded_input_or_a_leaf_clearly() -> None:
    for training in (True, False):
        layer = syncbn.InPlaceSyncBatchNorm2d(4).train(training)
        torch._dynamo.reset()
        compiled = torch.compile(lambda t, layer=layer: layer(t.expand(2, 4, 3, 3)), backend="eager")
        with pytest.raises(RuntimeError, match="several elements in one memory location"):
            compiled(torch.randn(2, 4, 1, 3))
        assert int(layer.num_batches_tracked) == 0 and torch.equal(layer.running_mean, torch.zeros(4))
    layer = syncbn.InPlaceSyncBatchNorm2d(4)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="which here is a leaf tensor that requires grad"):
        torch.compile(layer, backend="eager")(torch.randn(2, 4, 3, 3, requires_grad=True))
    assert int(layer.num_batches_tracked) == 0
    torch._dynamo.reset()


def test_fuse_and_revert() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.BatchNorm2d(6),
        nn.LeakyReLU(0.1),
        nn.Conv2d(6, 4, 1),
        nn.BatchNorm2d(4),
        nn.ELU(),
    )
    with torch.no_grad():
        for i in (1, 4):
            model[i].weight.uniform_(0.5, 2.0)
            model[i].running_mean.normal_()
            model[i].running_var.uniform_(0.5, 2.0)
    keys = list(model.state_dict())
    weight = model[1].weight
    x = torch.randn(2, 3, 7, 7)
    model.eval()
    expected = model(x)
    assert syncbn.fuse_batchnorm_activation(model) is model
    assert [type(m).__name__ for m in model] == [
        "Conv2d",
        "InPlaceSyncBatchNorm2d",
        "Identity",
        "Conv2d",
        "InPlaceSyncBatchNorm2d",
        "Identity",
    ]
    assert list(model.state_dict()) == keys and model[1].weight is weight
    assert (model[1].activation, model[1].activation_param, model[4].activation) == ("leaky_relu", 0.1, "elu")
    assert torch.allclose(model(x), expected, atol=1e-6)
    reverted = syncbn.revert_sync_batchnorm(model)
    assert isinstance(reverted[1], nn.Sequential) and isinstance(reverted[1][0], nn.BatchNorm2d)
    assert torch.allclose(reverted(x), expected, atol=1e-6)
    # A weight below eps cannot be represented exactly: refused, the model unchanged.
    other = nn.Sequential(nn.BatchNorm1d(3), nn.LeakyReLU())
    with torch.no_grad():
        other[0].weight.copy_(torch.tensor([1.0, -0.5, 0.0]))
    with pytest.raises(ValueError, match=r"0 \(2 of 3 channels\)"):
        syncbn.fuse_batchnorm_activation(other)
    assert isinstance(other[0], nn.BatchNorm1d) and other[0].weight[1] == -0.5
    with pytest.warns(UserWarning, match="clamped to 0"):
        syncbn.fuse_batchnorm_activation(other, strict=False)
    assert isinstance(other[0], syncbn.InPlaceSyncBatchNorm) and not isinstance(other[0], nn.BatchNorm1d)
    # ReLU pairs are not fused; convert_sync_batchnorm sets the group of the native layers only.
    relu = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU())
    assert isinstance(syncbn.fuse_batchnorm_activation(relu)[0], nn.BatchNorm2d)
    marker = object()
    native = nn.Sequential(nn.Conv2d(3, 3, 1), syncbn.InPlaceSyncBatchNorm2d(3), nn.BatchNorm2d(3))
    syncbn.convert_sync_batchnorm(native, process_group=marker)
    assert native[1].process_group is marker and isinstance(native[2], syncbn.SyncBatchNorm2d)


def test_pickle_deepcopy_and_warning_without_a_process_group() -> None:
    layer = InPlaceABNSync(3)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, InPlaceABNSync) and loaded.group is None
    assert pickle.loads(pickle.dumps(syncbn.InPlaceSyncBatchNorm2d(3))).num_features == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inplace_abn_sync(torch.randn(4, 3) * 1.0, None, None, None, None)
    assert any(issubclass(w.category, RuntimeWarning) for w in caught)


def test_local_inplace_abn_replicas_normalise_alone() -> None:
    class Double(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

    model = nn.Sequential(Double(), InPlaceABN(3)).double()
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    y = syncbn.parallel.data_parallel(model, x.clone(), [3, 4])
    expected = torch.cat(
        [
            F.leaky_relu(
                F.batch_norm(2 * c, None, None, torch.full((3,), 1 + 1e-5).double(), training=True), 0.01
            )
            for c in x.split([3, 4])
        ]
    )
    assert torch.allclose(y, expected, atol=1e-12)  # weight 1: scale 1 + eps


# torch.func: the layer runs the engine's setup_context Function under transforms (grad, vjp,
# vmap in eval); a second differentiation and vmap over batch statistics raise syncbn's errors.
def _func_layer() -> nn.Module:
    torch.manual_seed(0)
    layer = syncbn.InPlaceSyncBatchNorm2d(3, activation="elu", activation_param=0.5).double()
    with torch.no_grad():
        layer.weight.uniform_(-1.5, 1.5)
        layer.bias.uniform_(-1.0, 1.0)
        layer.running_mean.uniform_(-1.0, 1.0)
        layer.running_var.uniform_(0.5, 2.0)
    return layer


def _func_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 2, 2, dtype=torch.float64, generator=gen) * 2.0 + 0.5
    return x, torch.randn(n, 3, 2, 2, dtype=torch.float64, generator=gen)


def _func_cases(rank: int, world_size: int, sizes: tuple[int, ...] = (7,)) -> dict[str, object]:
    """``torch.func`` over the layer on this rank's shard of one global batch; errors and messages."""
    from torch.func import functional_call, grad, vjp, vmap

    out: dict[str, object] = {}
    layer = _func_layer()
    x, g = _func_data(sum(sizes))
    running = (layer.running_mean, layer.running_var)
    want = reference(x, g, layer.weight, layer.bias, running, activation="elu", param=0.5)
    lo = sum(sizes[:rank])
    xs, gs = x[lo : lo + sizes[rank]], g[lo : lo + sizes[rank]]
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    buffers = {k: v.clone() for k, v in layer.named_buffers()}
    # A plain step first: the thread's cached backward buffers exist before the transform (a captured
    # tensor it must not write into: once failed only after another test file had run in the process).
    copy.deepcopy(layer)(xs.clone().requires_grad_() * 1.0).backward(gs)

    def loss(p: dict, b: dict, t: torch.Tensor) -> torch.Tensor:
        return (functional_call(layer, (p, b), (t.clone(),)) * gs).sum()

    # Training, grad of weight, bias and input (buffers passed: their update is the reference's).
    gp, gx = grad(loss, argnums=(0, 2))(params, buffers, xs)
    dw, db = gp["weight"].clone(), gp["bias"].clone()
    if world_size > 1:
        torch.distributed.all_reduce(dw)
        torch.distributed.all_reduce(db)
    out["grad"] = max(
        max_error(gx, want["dx"][lo : lo + sizes[rank]]),
        max_error(dw, want["dw"]),
        max_error(db, want["db"]),
        max_error(buffers["running_mean"], want["rm"]),
        max_error(buffers["running_var"], want["rv"]),
    )
    # vjp: its function runs backward in grad mode after the transform exited. Training without
    # running statistics (its collective there), and eval with them.
    for training in (True, False):
        fresh = _func_layer().train(training)
        fresh.track_running_stats = not training
        running = None if training else (fresh.running_mean, fresh.running_var)
        want = reference(
            x, g, fresh.weight, fresh.bias, running, training=training, activation="elu", param=0.5
        )
        y, fn = vjp(lambda p, t, m=fresh: functional_call(m, p, (t.clone(),)), params, xs)
        gp, gx = fn(gs)
        dw, db = gp["weight"].clone(), gp["bias"].clone()
        if world_size > 1:
            torch.distributed.all_reduce(dw)
            torch.distributed.all_reduce(db)
        out[f"vjp training={training}"] = max(
            max_error(y, want["y"][lo : lo + sizes[rank]]),
            max_error(gx, want["dx"][lo : lo + sizes[rank]]),
            max_error(dw, want["dw"]),
            max_error(db, want["db"]),
        )
    # vmap over batch statistics: syncbn's error, before any state changes.
    before = [t.clone() for t in layer.buffers()]
    try:
        vmap(lambda t: layer(t.clone()))(xs.unsqueeze(1))
        out["vmap train"] = "ran"
    except NotImplementedError as exc:
        out["vmap train"] = str(exc)
    out["vmap train state"] = max(max_error(a, b) for a, b in zip(before, layer.buffers()))
    return out


def test_func_grad_vmap_in_training_one_process() -> None:
    result = _func_cases(0, 1)
    assert result["grad"] <= 1e-12
    assert result["vjp training=True"] <= 1e-12 and result["vjp training=False"] <= 1e-12, result
    assert "torch.func.vmap over an in-place activated batch norm" in str(result["vmap train"])
    assert "(got batch statistics" in str(result["vmap train"]) and result["vmap train state"] == 0.0


def test_func_grad_and_vmap_in_training_on_two_ranks() -> None:
    from _helpers.dist_harness import launch

    for rank, result in enumerate(launch(_func_cases, 2, (3, 5), timeout=120)):
        assert result["grad"] <= 1e-12, f"rank {rank}: {result}"
        assert result["vjp training=True"] <= 1e-12 and result["vjp training=False"] <= 1e-12, result
        assert "torch.func.vmap over an in-place activated batch norm" in str(result["vmap train"]), rank
        assert result["vmap train state"] == 0.0


def test_func_second_differentiation_raises_clearly() -> None:
    from torch.func import functional_call, grad

    layer = _func_layer()
    x, g = _func_data(6)
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}

    def loss(p: dict, b: dict) -> torch.Tensor:
        return (functional_call(layer, (p, b), (x.clone(),)) * g).sum()

    def penalty(p: dict, b: dict) -> torch.Tensor:
        return grad(loss)(p, b)["weight"].pow(2).sum()

    with pytest.raises(RuntimeError, match="double backward"):  # never a silent zero
        grad(penalty)(params, {k: v.clone() for k, v in layer.named_buffers()})


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_func_vmap_in_eval_equals_the_reference(strided: bool) -> None:
    from torch.func import grad, vmap

    layer = _func_layer().eval()
    x, g = _func_data(6)
    running = (layer.running_mean, layer.running_var)
    want = reference(x, g, layer.weight, layer.bias, running, training=False, activation="elu", param=0.5)

    def batched(t: torch.Tensor) -> torch.Tensor:  # samples of one image, or of two (a strided view)
        return t.view(2, 3, 3, 2, 2).transpose(0, 1) if strided else t.view(6, 1, 3, 2, 2)

    def unbatched(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).reshape(x.shape) if strided else t.reshape(x.shape)

    with torch.no_grad():
        y = vmap(lambda t: layer(t.clone()))(batched(x))
    assert max_error(unbatched(y), want["y"]) <= 1e-12

    def per_sample(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (layer(t.clone()) * u).sum()

    dx = vmap(grad(per_sample))(batched(x), batched(g))  # per-sample input gradients
    assert max_error(unbatched(dx), want["dx"]) <= 1e-12


def test_training_under_inference_mode_and_functional_sizes() -> None:
    """Training under ``torch.inference_mode`` works as ``no_grad`` does; the functional forms
    refuse a bias or running statistic without one element per channel before writing anything."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    layers = [syncbn.InPlaceSyncBatchNorm(3, activation="identity").double() for _ in range(2)]
    with torch.no_grad():
        expected = layers[0](x.clone())
    with torch.inference_mode():
        got = layers[1](x.clone())
    assert torch.equal(got, expected)
    assert torch.equal(layers[1].running_var, layers[0].running_var)
    assert int(layers[1].num_batches_tracked) == 1
    three, four = torch.ones(3, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    for bad in ("bias", "running_mean", "running_var"):
        args = {"bias": three.clone(), "running_mean": three.clone(), "running_var": three.clone(), bad: four}
        for function in (inplace_abn, inplace_abn_sync):
            h = x.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # inplace_abn_sync without a group
                with pytest.raises(ValueError, match=f"expected {bad} with 3 elements.*got 4"):
                    function(h, three, args["bias"], args["running_mean"], args["running_var"], True)
            assert torch.equal(h, x) and torch.equal(
                args["running_mean"] if bad != "running_mean" else three, three
            )
