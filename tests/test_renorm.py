"""SyncBatchRenorm: exact against Ioffe's formulas on the global batch (float64), on every path.

One process: the layer alone (no group), ``nn.DataParallel`` replicas through
``syncbn.parallel.data_parallel`` (uneven and empty chunks), ``torch.compile``
(fullgraph), conversion and reversion, the constructor's checks. Two gloo
ranks: eager, DDP, compiled, uneven and empty per-rank batches (see
``_distributed``). ``r_max=1, d_max=0`` is ``SyncBatchNorm`` bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import syncbn
from _helpers.dist_harness import launch
from _helpers.marks import HAS_COMPILED_OPS, needs_compiled_ops
from _helpers.renorm_reference import renorm_reference

C = 4
EPS = 1e-5


def _layer(cls: type = syncbn.SyncBatchRenorm1d, r_max: float = 1.5, d_max: float = 0.4) -> nn.Module:
    layer = cls(C, dtype=torch.float64, r_max=r_max, d_max=d_max)
    torch.manual_seed(3)
    with torch.no_grad():
        layer.running_mean.uniform_(-1.0, 1.0)
        layer.running_var.uniform_(0.3, 3.0)
        layer.weight.uniform_(-1.5, 1.5)
        layer.bias.uniform_(-1.0, 1.0)
    return layer


def _data(n: int, seed: int = 0, extra: tuple[int, ...] = (3,)) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, *extra, dtype=torch.float64, generator=g) * 2.0 + 0.7
    return x, torch.randn(n, C, *extra, dtype=torch.float64, generator=g)


def _expected(layer: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, rm, rv = renorm_reference(
        xr, w, b, layer.running_mean.clone(), layer.running_var.clone(), layer.r_max, layer.d_max
    )
    (y * g).sum().backward()
    return {"y": y.detach(), "dx": xr.grad, "dw": w.grad, "db": b.grad, "rm": rm, "rv": rv}


def _max_err(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    return max(float((got[k].detach() - want[k]).abs().max()) if want[k].numel() else 0.0 for k in want)


def _step(layer: nn.Module, x: Tensor, g: Tensor, run: Any = None) -> dict[str, Tensor]:
    xg = x.detach().clone().requires_grad_()
    y = (layer if run is None else run)(xg)
    (y * g).sum().backward()
    return {
        "y": y.detach(), "dx": xg.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
        "rm": layer.running_mean.clone(), "rv": layer.running_var.clone(),
    }  # fmt: skip


def _double_backward(
    run: Any, weight: Tensor, bias: Tensor, x: Tensor, g: Tensor, h: Tensor
) -> dict[str, Tensor]:
    """First-order gradients with ``create_graph=True``, then those of a penalty linear in them.

    The penalty ``sum(dx * h) + sum(dw * v) + sum(db * v)`` (random ``h``, fixed ``v``) sums over
    ranks to the global batch's, so its gradients compare shard by shard (weight/bias: summed).
    """
    xg = x.detach().clone().requires_grad_()
    dx, dw, db = torch.autograd.grad(run(xg), (xg, weight, bias), g, create_graph=True)
    v = torch.linspace(-0.5, 1.5, x.shape[1], dtype=x.dtype)
    penalty = (dx * h).sum() + (dw * v).sum() + (db * v).sum()
    second = torch.autograd.grad(penalty, (xg, weight, bias), allow_unused=True)
    ggx, ggw, ggb = (torch.zeros_like(t) if s is None else s for s, t in zip(second, (xg, weight, bias)))
    out = {"dx": dx, "dw": dw, "db": db, "ggx": ggx, "ggw": ggw, "ggb": ggb}
    return {k: t.detach() for k, t in out.items()}


def _double_backward_expected(layer: nn.Module, x: Tensor, g: Tensor, h: Tensor) -> dict[str, Tensor]:
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    rm, rv = layer.running_mean.clone(), layer.running_var.clone()

    def run(t: Tensor) -> Tensor:
        return renorm_reference(t, w, b, rm, rv, layer.r_max, layer.d_max)[0]

    return _double_backward(run, w, b, x, g, h)


@pytest.mark.parametrize("shape", [(), (3,)], ids=["NC", "NCL"])
def test_double_backward_equals_the_formulas(shape: tuple[int, ...]) -> None:
    # A gradient penalty through the layer trains its weight: d(dx)/d(weight) = r * invstd * (...)
    # with r constant (it was computed from a detached weight: a silent zero before).
    layer = _layer()
    x, g = _data(7, extra=shape)
    h = _data(7, seed=1, extra=shape)[1]
    want = _double_backward_expected(layer, x, g, h)
    got = _double_backward(layer, layer.weight, layer.bias, x, g, h)
    assert float(want["ggw"].abs().max()) > 0.1  # (the case tests something)
    assert _max_err(got, want) <= 1e-10, {k: float((got[k] - want[k]).abs().max()) for k in want}


@pytest.mark.parametrize("shape", [(), (3,)], ids=["NC", "NCL"])
def test_single_process_equals_the_formulas(shape: tuple[int, ...]) -> None:
    layer = _layer()
    x, g = _data(7, extra=shape)
    want = _expected(layer, x, g)
    assert _max_err(_step(layer, x, g), want) <= 1e-12
    assert int(layer.num_batches_tracked) == 1


def test_clamps_are_active_in_the_test_data() -> None:
    layer = _layer()
    x, _ = _data(7)
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    r = ((var + EPS).sqrt() / (layer.running_var + EPS).sqrt()).abs()
    d = ((mean - layer.running_mean) / (layer.running_var + EPS).sqrt()).abs()
    assert ((r > 1.5) | (r < 1 / 1.5)).any() and ((r < 1.5) & (r > 1 / 1.5)).any()
    assert (d > 0.4).any() and (d < 0.4).any()


def test_r1_d0_is_sync_batchnorm_bit_for_bit() -> None:
    ours, bn = _layer(r_max=1.0, d_max=0.0), syncbn.SyncBatchNorm1d(C, dtype=torch.float64)
    bn.load_state_dict(ours.state_dict())
    x, g = _data(6)
    a, b = _step(ours, x, g), _step(bn, x, g)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_is_batchnorm_with_running_stats_and_no_tracking_is_batchnorm() -> None:
    layer = _layer().eval()
    bn = nn.BatchNorm1d(C, dtype=torch.float64).eval()
    bn.load_state_dict(layer.state_dict())
    x, _ = _data(5)
    assert torch.equal(layer(x), bn(x))
    plain = syncbn.SyncBatchRenorm1d(C, track_running_stats=False, dtype=torch.float64)
    ref = nn.BatchNorm1d(C, track_running_stats=False, dtype=torch.float64)
    assert torch.equal(plain(x), ref(x))


def test_momentum_none_is_cumulative() -> None:
    layer = _layer()
    layer.momentum = None
    layer.num_batches_tracked.fill_(3)
    x, g = _data(6)
    rm0, rv0 = layer.running_mean.clone(), layer.running_var.clone()
    layer(x)
    n = x.numel() // C
    assert torch.allclose(layer.running_mean, 0.75 * rm0 + 0.25 * x.mean((0, 2)), atol=1e-14)
    assert torch.allclose(layer.running_var, 0.75 * rv0 + 0.25 * x.var((0, 2)) * 1.0, atol=1e-14)
    assert n > 1


@pytest.mark.parametrize("chunks", [[3, 4], [5, 0, 2], [7]], ids=["even", "empty", "one"])
def test_data_parallel_replicas_equal_the_formulas(chunks: list[int]) -> None:
    layer = _layer()
    x, g = _data(7)
    want = _expected(layer, x, g)
    model = nn.Sequential(layer)
    got = _step(layer, x, g, run=lambda t: syncbn.parallel.data_parallel(model, t, chunks))
    assert _max_err(got, want) <= 1e-12


@needs_compiled_ops
def test_compiled_fullgraph_equals_the_formulas() -> None:
    torch._dynamo.reset()
    layer = _layer()
    x, g = _data(7)
    want = _expected(layer, x, g)
    compiled = torch.compile(layer, fullgraph=True)
    assert _max_err(_step(layer, x, g, run=compiled), want) <= 1e-12


def test_convert_and_revert() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Linear(2, 2), nn.BatchNorm1d(4)).double()
    state = copy.deepcopy(model.state_dict())
    renorm = syncbn.convert_to_renorm(model, r_max=2.0, d_max=1.0)
    assert type(renorm[1]) is syncbn.SyncBatchRenorm2d and type(renorm[3]) is syncbn.SyncBatchRenorm1d
    assert (renorm[1].r_max, renorm[1].d_max) == (2.0, 1.0)
    assert "r_max=2, d_max=1" in repr(renorm[1])
    assert syncbn.convert_sync_batchnorm(renorm)[1] is renorm[1]  # kept as it is
    plain = syncbn.revert_sync_batchnorm(renorm)
    assert type(plain[1]) is nn.BatchNorm2d and type(plain[3]) is nn.BatchNorm1d
    assert not hasattr(plain[1], "r_max")
    fresh = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Linear(2, 2), nn.BatchNorm1d(4)).double()
    fresh.load_state_dict(plain.state_dict(), strict=True)
    layer = syncbn.SyncBatchRenorm2d(4, dtype=torch.float64)
    layer.load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("1.")}, strict=True)
    assert set(layer.state_dict()) == set(nn.BatchNorm2d(4).state_dict())
    assert type(syncbn.revert_sync_batchnorm(syncbn.SyncBatchRenorm(3))) is syncbn.convert.BatchNorm


def test_constructor_checks_and_generic_class() -> None:
    with pytest.raises(ValueError, match=r"expected r_max >= 1 \(got 0.5\)"):
        syncbn.SyncBatchRenorm2d(3, r_max=0.5)
    with pytest.raises(ValueError, match=r"expected d_max >= 0 \(got -1"):
        syncbn.SyncBatchRenorm(3, d_max=-1.0)
    with pytest.raises(ValueError, match="expected 4D input"):
        syncbn.SyncBatchRenorm2d(3)(torch.randn(2, 3))
    assert syncbn.SyncBatchRenorm(3)(torch.randn(2, 3, 2, 2, 2)).shape == (2, 3, 2, 2, 2)
    assert isinstance(syncbn.SyncBatchRenorm3d(3), nn.BatchNorm3d)


def test_limits_take_any_real_number_and_name_the_type_of_anything_else() -> None:
    import numpy as np

    x, g = _data(6)
    want = _step(_layer(r_max=2.0, d_max=0.5), x, g)
    for r_max, d_max in ((np.float32(2.0), np.float64(0.5)), (2, np.float32(0.5)), (np.int64(2), 0.5)):
        layer = _layer()
        layer.r_max, layer.d_max = r_max, d_max  # e.g. from a NumPy schedule, between steps
        got = _step(layer, x, g)
        assert all(torch.equal(got[k], want[k]) for k in want), (r_max, d_max)
        assert type(syncbn.SyncBatchRenorm1d(C, r_max=r_max, d_max=d_max).r_max) is float
    for value, kind in (
        (torch.tensor(2.0), "torch.Tensor"),
        ("2", "builtins.str"),
        (None, "builtins.NoneType"),
    ):
        layer = _layer()
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        layer.r_max = value
        with pytest.raises(ValueError, match=rf"expected r_max to be a real number >= 1: .*of type {kind}"):
            layer(x)
        assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
        with pytest.raises(ValueError, match=rf"expected d_max to be a real number >= 0: .*of type {kind}"):
            syncbn.SyncBatchRenorm1d(C, d_max=value)
    with pytest.raises(ValueError, match=r"expected r_max >= 1 \(got 0.5\)"):
        syncbn.SyncBatchRenorm1d(C, r_max=np.float32(0.5))


@pytest.mark.parametrize(
    ("buffer", "value", "named"),
    [
        ("running_var", float("nan"), "running_var holds NaN or Inf"),
        ("running_var", -5.0, "running_var is negative"),
        ("running_mean", float("inf"), "running_mean holds NaN or Inf"),
    ],
    ids=["nan-var", "negative-var", "inf-mean"],
)
def test_debug_mode_names_invalid_running_statistics_before_any_update(
    buffer: str, value: float, named: str
) -> None:
    layer = _layer()
    with torch.no_grad():
        getattr(layer, buffer)[1] = value  # e.g. a corrupt checkpoint
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x, _ = _data(6)
    syncbn.set_debug(True)
    try:
        with pytest.raises(
            ValueError, match=rf"SyncBatchRenorm1d\(4\).*invalid running statistics \({named}\)"
        ):
            layer(x)
        torch.testing.assert_close(dict(layer.state_dict()), before, rtol=0, atol=0, equal_nan=True)
        assert int(layer.num_batches_tracked) == 0
        # Not read in training: batch norm's path (r_max=1, d_max=0), and eval, run as before.
        layer.r_max, layer.d_max = 1.0, 0.0
        assert not layer(x)[:, 0].isnan().any()
        layer.eval()(x)
    finally:
        syncbn.set_debug(None)


# Two gloo ranks: each takes its shard of one global batch (uneven, and one rank empty).
SHARDS = {"uneven": (3, 5), "empty": (0, 6)}


def _shard(t: Tensor, rank: int, sizes: tuple[int, int]) -> Tensor:
    lo = sum(sizes[:rank])
    return t[lo : lo + sizes[rank]]


def _distributed(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, sizes in SHARDS.items():
        for cls, extra in ((syncbn.SyncBatchRenorm1d, (3,)), (syncbn.SyncBatchRenorm2d, (2, 2))):
            layer = _layer(cls)
            x, g = _data(sum(sizes), seed=7, extra=extra)
            want = _expected(layer, x, g)
            got = _step(layer, _shard(x, rank, sizes), _shard(g, rank, sizes))
            # Input gradients and outputs are this rank's rows; weight/bias gradients summed over ranks.
            for key in ("dw", "db"):
                torch.distributed.all_reduce(got[key])
            want["y"], want["dx"] = _shard(want["y"], rank, sizes), _shard(want["dx"], rank, sizes)
            out[f"eager-{name}-{cls.__name__}"] = _max_err(got, want)
        # Double backward (a gradient penalty): first- and second-order gradients of x, weight, bias.
        layer = _layer()
        x, g = _data(sum(sizes), seed=5)
        h = _data(sum(sizes), seed=6)[1]
        want = _double_backward_expected(layer, x, g, h)
        shards = [_shard(t, rank, sizes) for t in (x, g, h)]
        got = _double_backward(layer, layer.weight, layer.bias, *shards)
        for key in ("dw", "db", "ggw", "ggb"):
            got[key] = got[key].detach().clone()
            torch.distributed.all_reduce(got[key])
        for key in ("dx", "ggx"):
            want[key] = _shard(want[key], rank, sizes)
        out[f"double-backward-{name}"] = _max_err(got, want)
        # DDP (which sums the parameter gradients) and compiled, 1d.
        layer = _layer()
        x, g = _data(sum(sizes), seed=11)
        want = _expected(layer, x, g)
        want["y"], want["dx"] = _shard(want["y"], rank, sizes), _shard(want["dx"], rank, sizes)
        want["dw"], want["db"] = want["dw"] / world_size, want["db"] / world_size
        ddp = nn.parallel.DistributedDataParallel(layer)
        out[f"ddp-{name}"] = _max_err(_step(layer, _shard(x, rank, sizes), _shard(g, rank, sizes), ddp), want)
        if not HAS_COMPILED_OPS:  # (syncbn has no compiled form there: see test_compile.py)
            continue
        torch._dynamo.reset()
        layer = _layer()
        want = _expected(layer, x, g)
        want["y"], want["dx"] = _shard(want["y"], rank, sizes), _shard(want["dx"], rank, sizes)
        # aot_eager: the traced Function and its explicit backward as AOTAutograd runs them. (Not
        # inductor: these ranks are forked from a process whose inductor, used by the single-process
        # test above, holds compile workers; on torch 2.15 a forked child then hangs in inductor.)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got = _step(layer, _shard(x, rank, sizes), _shard(g, rank, sizes), compiled)
        for key in ("dw", "db"):
            torch.distributed.all_reduce(got[key])
        out[f"compiled-{name}"] = _max_err(got, want)
    return out


@pytest.fixture(scope="module")
def distributed() -> list[dict[str, float]]:
    return launch(_distributed, 2, timeout=300)


@pytest.mark.parametrize("shards", list(SHARDS))
@pytest.mark.parametrize(
    "path", ["eager", "ddp", "double-backward", pytest.param("compiled", marks=needs_compiled_ops)]
)
def test_two_ranks_equal_the_formulas_on_the_global_batch(
    distributed: list[dict[str, float]], path: str, shards: str
) -> None:
    for rank, result in enumerate(distributed):
        errors = {k: v for k, v in result.items() if k.startswith(f"{path}-{shards}")}
        assert errors and max(errors.values()) <= 1e-10, f"rank {rank}: {errors}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_renorm_updates_statistics_once(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    layer = _layer()
    x, g = _data(7)
    want = _expected(layer, x, g)
    lin = nn.Identity()

    def run(t: Tensor) -> Tensor:
        out: Tensor = checkpoint(lambda u: layer(lin(u) * 1.0), t, use_reentrant=reentrant)
        return out

    assert _max_err(_step(layer, x, g, run=run), want) <= 1e-12
    assert int(layer.num_batches_tracked) == 1


def test_func_grad_equals_the_formulas() -> None:
    layer = _layer()
    x, g = _data(7)
    want = _expected(layer, x, g)
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    buffers = {k: v.clone() for k, v in layer.named_buffers()}

    def loss(p: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
        return (torch.func.functional_call(layer, (p, b), (x,)) * g).sum()

    grads = torch.func.grad(loss)(params, buffers)
    assert float((grads["weight"] - want["dw"]).abs().max()) <= 1e-12
    assert float((grads["bias"] - want["db"]).abs().max()) <= 1e-12


def test_bias_false_and_a_layer_used_under_torch_func_stays_copyable() -> None:
    """``bias=False`` as SyncBatchNorm's (the repr shows it); after ``torch.func.grad`` over
    ``functional_call`` the layer keeps no torch.func wrapper (deepcopy and pickling work)."""
    layer = syncbn.SyncBatchRenorm2d(3, bias=False, r_max=1.5, d_max=0.5).double()
    assert layer.bias is None and layer.weight is not None
    assert repr(syncbn.SyncBatchNorm2d(3, bias=False))[len("SyncBatchNorm2d") : -1] in repr(layer)
    assert set(layer.state_dict()) == set(syncbn.SyncBatchNorm2d(3, bias=False).state_dict())
    converted = syncbn.convert_to_renorm(syncbn.SyncBatchNorm2d(3, bias=False))
    assert isinstance(converted, syncbn.SyncBatchRenorm2d) and converted.bias is None
    layer = syncbn.SyncBatchRenorm1d(3, r_max=1.5, d_max=0.5).double()
    x, g = torch.randn(4, 3, 2, dtype=torch.float64), torch.randn(4, 3, 2, dtype=torch.float64)
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    buffers = dict(layer.named_buffers())

    def loss(p: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
        return (torch.func.functional_call(layer, (p, b), (x,)) * g).sum()

    torch.func.grad(loss)(params, buffers)
    before = layer.__dict__["_renorm_before"]
    assert all(
        type(t) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(t) for t in before
    )
    copy.deepcopy(layer)
