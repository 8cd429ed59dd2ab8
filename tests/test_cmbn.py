"""CmBN: ``syncbn.accumulation(model, normalize="cumulative")`` against its definition.

Micro-batch t of a block is normalised with the count, mean and biased variance of micro-batches
1..t of all ranks, the earlier ones constants. The reference is computed by hand in float64 on
the concatenation ``cat(x_1.detach(), ..., x_{t-1}.detach(), x_t)`` of the global micro-batches,
keeping the rows of micro-batch t (this rank's share), with a random upstream gradient: output,
input gradient, weight and bias gradients (summed over the block), and the running statistics
after the block (``nn.BatchNorm`` once on every micro-batch together).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import syncbn
from _helpers.marks import needs_compiled_ops

pytestmark = pytest.mark.timeout(240)

TOL = 1e-10
C = 3
EPS = 1e-5
R_MAX, D_MAX = 1.5, 0.4
SLOPE = 0.1
FAMILIES = ("bn", "renorm", "inplace")


def make_layer(family: str, momentum: float | None = 0.1, seed: int = 0) -> nn.Module:
    """A float64 layer of ``family`` with non-trivial parameters and running statistics."""
    torch.manual_seed(seed)
    if family == "bn":
        layer: nn.Module = syncbn.SyncBatchNorm2d(C, momentum=momentum)
    elif family == "renorm":
        layer = syncbn.SyncBatchRenorm2d(C, momentum=momentum, r_max=R_MAX, d_max=D_MAX)
    else:
        layer = syncbn.InPlaceSyncBatchNorm2d(C, momentum=momentum, activation_param=SLOPE)
    layer = layer.double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
        layer.running_mean.uniform_(0.0, 2.0)
        layer.running_var.uniform_(0.5, 6.0)
        layer.num_batches_tracked.fill_(3)
    return layer


def definition(
    family: str, layer: nn.Module, earlier: list[Tensor], x: Tensor, weight: Tensor, bias: Tensor
) -> Tensor:
    """Micro-batch ``x`` normalised with ``earlier`` (constants) and itself, by the definition."""
    pooled = torch.cat([*(e.detach() for e in earlier), x])
    dims, shape = [0, 2, 3], [1, -1, 1, 1]
    mean, var = pooled.mean(dims), pooled.var(dims, unbiased=False)
    xhat = (x - mean.view(shape)) / (var + EPS).sqrt().view(shape)
    if family == "renorm":  # r, d from the pooled statistics and the running ones before the block
        s = (layer.running_var + EPS).sqrt()
        r = ((var + EPS).sqrt() / s).clamp(1 / R_MAX, R_MAX).detach()
        d = ((mean - layer.running_mean) / s).clamp(-D_MAX, D_MAX).detach()
        xhat = xhat * r.view(shape) + d.view(shape)
    scale = weight.abs() + EPS if family == "inplace" else weight
    y = xhat * scale.view(shape) + bias.view(shape)
    return F.leaky_relu(y, SLOPE) if family == "inplace" else y


def reference(
    family: str, layer: nn.Module, earlier: list[Tensor], x: Tensor, grad: Tensor, rows: slice
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, dx, dweight, dbias)`` of this rank's ``rows`` of the global micro-batch ``x``, by the
    definition; ``grad``: every rank's upstream gradient (the weight and bias ones stay local)."""
    x = x.detach().clone().requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    y = definition(family, layer, earlier, x, weight, bias)
    (dx,) = torch.autograd.grad(y, x, grad, retain_graph=True)
    dw, db = torch.autograd.grad(y[rows], (weight, bias), grad[rows])
    return y[rows].detach(), dx[rows], dw, db


def expected_running(layer: nn.Module, micro: list[Tensor]) -> dict[str, Tensor]:
    """``nn.BatchNorm``'s state after one training forward over every micro-batch together."""
    bn = nn.BatchNorm2d(C, momentum=layer.momentum).double()
    bn.load_state_dict({k: v for k, v in layer.state_dict().items() if k in bn.state_dict()})
    bn(torch.cat(micro))
    return bn.state_dict()


def data(seed: int, sizes: list[list[int]]) -> list[list[Tensor]]:
    """``sizes[t][r]`` samples of micro-batch t on rank r (the same on every rank), mean 1, std 2."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, C, 2, 2, generator=gen, dtype=torch.float64) * 2 + 1 for n in row] for row in sizes
    ]


def run_block(
    family: str,
    shards: list[list[Tensor]],
    rank: int,
    call: Callable[[nn.Module, Tensor], Tensor] | None = None,
    momentum: float | None = 0.1,
    module: Callable[[nn.Module], nn.Module] | None = None,
    averaged: int = 0,
) -> dict[str, float]:
    """One cumulative block over ``shards[t][r]`` on this rank: the worst error of each quantity.

    ``call(model, x)`` runs the model (default: a plain call); ``module`` wraps the layer (DDP);
    ``averaged``: the world size when the weight and bias gradients are averaged over the ranks (DDP).
    """
    layer = make_layer(family, momentum)
    before = make_layer(family, momentum)  # its state before the block (the reference's)
    model = module(layer) if module is not None else layer
    run = call or (lambda m, x: m(x))
    gen = torch.Generator().manual_seed(100)  # the same on every rank
    worst = {"y": 0.0, "dx": 0.0, "dw": 0.0, "db": 0.0, "running": 0.0}
    dw = torch.zeros(C, dtype=torch.float64)
    db = torch.zeros(C, dtype=torch.float64)
    micro = [torch.cat(row) for row in shards]
    with syncbn.accumulation(model, normalize="cumulative"):
        for t, row in enumerate(shards):
            start = sum(s.shape[0] for s in row[:rank])
            rows = slice(start, start + row[rank].shape[0])
            grads = torch.randn(micro[t].shape, generator=gen, dtype=torch.float64)  # every rank's
            leaf = row[rank].clone().requires_grad_()
            y = run(model, leaf.clone())  # (a clone: the in-place family writes over its input)
            y.backward(grads[rows])
            ry, rdx, rdw, rdb = reference(family, before, micro[:t], micro[t], grads, rows)
            if averaged:  # every rank's rows, averaged
                _, _, rdw, rdb = reference(family, before, micro[:t], micro[t], grads, slice(None))
                rdw, rdb = rdw / averaged, rdb / averaged
            worst["y"] = max(worst["y"], _err(y, ry))
            worst["dx"] = max(worst["dx"], _err(leaf.grad, rdx))
            dw += rdw
            db += rdb
    worst["dw"] = _err(layer.weight.grad, dw)
    worst["db"] = _err(layer.bias.grad, db)
    state = expected_running(before, micro)
    for key in ("running_mean", "running_var"):
        worst["running"] = max(worst["running"], _err(getattr(layer, key), state[key]))
    assert int(layer.num_batches_tracked) == int(state["num_batches_tracked"])
    return worst


def _err(a: Tensor | None, b: Tensor) -> float:
    assert a is not None
    return 0.0 if b.numel() == 0 else (a.detach() - b.detach()).abs().max().item()


# --- one process ----------------------------------------------------------------------------------

SIZES_1 = [[2], [3], [1], [0], [2]]  # uneven, an empty micro-batch, micro-batches of one sample


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_eager(family: str, momentum: float | None) -> None:
    worst = run_block(family, data(1, SIZES_1), 0, momentum=momentum)
    assert max(worst.values()) < TOL, worst


def _region(model: nn.Module, x: Tensor, reentrant: bool) -> Tensor:
    # (x * 1.0 inside the region: the in-place family writes over the region's own tensor)
    return torch.utils.checkpoint.checkpoint(lambda t: model(t * 1.0), x, use_reentrant=reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_recomputation_reuses_the_carry(family: str, reentrant: bool) -> None:
    worst = run_block(family, data(2, SIZES_1), 0, call=lambda m, x: _region(m, x, reentrant))
    assert max(worst.values()) < TOL, worst


class Through(nn.Module):
    """``x * 1``: the in-place family's input is then an intermediate, as after a convolution."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 1.0


def _after_through(layer: nn.Module) -> nn.Module:
    return nn.Sequential(Through(), layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_data_parallel_replicas(family: str) -> None:
    # syncbn.parallel.data_parallel: nn.DataParallel's code path on CPU threads; a micro-batch of
    # one sample leaves one replica empty.
    call = lambda m, x: syncbn.parallel.data_parallel(m, x, chunks=2)  # noqa: E731
    worst = run_block(family, data(3, [[4], [3], [1], [2]]), 0, call=call, module=_after_through)
    assert max(worst.values()) < TOL, worst


@needs_compiled_ops
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_fullgraph_once(family: str) -> None:
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd, as inductor sees it
    compiled: dict[int, Any] = {}

    frames: list[int] = []

    def call(model: nn.Module, x: Tensor) -> Tensor:
        first = id(model) not in compiled
        run = compiled.setdefault(id(model), torch.compile(model, backend=counter, fullgraph=True))
        out = run(x)
        if not first:  # no recompilation per micro-batch (the carry's state is tensors)
            assert counter.frame_count == frames[-1]
        frames.append(counter.frame_count)
        return out  # type: ignore[no-any-return]

    for seed in (4, 5):  # two blocks, each a new model
        worst = run_block(family, data(seed, [[3]] * 4), 0, call=call, module=_after_through)
        assert max(worst.values()) < TOL, worst
    assert 1 <= counter.frame_count <= 2 and len(frames) == 8


def test_masked_input() -> None:
    # The statistics are those of the valid positions of micro-batches 1..t.
    layer, before = make_layer("bn"), make_layer("bn")
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, C, 2, 2, generator=gen, dtype=torch.float64) + 1 for n in (2, 3, 2)]
    masks = [torch.rand(n, 2, 2, generator=gen) > 0.4 for n in (2, 3, 2)]
    valid = [x.movedim(1, -1)[m].reshape(-1, C, 1, 1) for x, m in zip(xs, masks)]
    with syncbn.accumulation(layer, normalize="cumulative"):
        for t, (x, mask) in enumerate(zip(xs, masks)):
            leaf = x.clone().requires_grad_()
            y = layer(leaf, mask)
            grad = torch.randn(y.shape, generator=gen, dtype=torch.float64)
            y.backward(grad)
            g = grad.movedim(1, -1)[mask].reshape(-1, C, 1, 1)
            ry, rdx, _, _ = reference("bn", before, valid[:t], valid[t], g, slice(None))
            assert _err(y.movedim(1, -1)[mask].reshape(-1, C, 1, 1), ry) < TOL
            assert _err(leaf.grad.movedim(1, -1)[mask].reshape(-1, C, 1, 1), rdx) < TOL
            assert torch.all(leaf.grad.movedim(1, -1)[~mask] == 0)
    state = expected_running(before, valid)
    assert _err(layer.running_var, state["running_var"]) < TOL


def test_exception_leaves_the_statistics_and_the_next_block_starts_afresh() -> None:
    layer = make_layer("renorm")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(KeyError):
        with syncbn.accumulation(layer, normalize="cumulative"):
            for x in data(7, [[3], [2]]):
                layer(x[0])
            raise KeyError("stop")
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "_syncbn_cmbn" not in layer.__dict__
    worst = run_block("renorm", data(8, [[2], [3]]), 0)  # (a new layer with the same state)
    assert max(worst.values()) < TOL, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_and_frozen_layers_never_accumulate(family: str) -> None:
    layer = make_layer(family)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    ref = make_layer(family).eval()
    x = data(9, [[4]])[0][0]
    with syncbn.accumulation(layer, normalize="cumulative"):
        layer.eval()
        assert torch.equal(layer(x.clone()), ref(x.clone()))
        if family != "inplace":
            layer.train()
            layer.freeze = True
            assert torch.allclose(layer(x.clone()), ref(x.clone()), rtol=0, atol=1e-12)
        assert float(layer.__dict__["_syncbn_cmbn"].count) == 0.0
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_refusals_change_nothing() -> None:
    with pytest.raises(ValueError, match="expected normalize one of"):
        syncbn.accumulation(nn.Sequential(), normalize="cumulative-ish")
    model = nn.Sequential(make_layer("bn"), nn.BatchNorm2d(C).double())
    with pytest.raises(TypeError, match=r"normalize='cumulative'.*torch.nn.modules.batchnorm.BatchNorm2d"):
        syncbn.accumulation(model, normalize="cumulative").begin()
    assert "_syncbn_cmbn" not in model[0].__dict__
    with syncbn.accumulation(model):  # micro-batch normalisation covers plain BatchNorm (no layer left open)
        model(data(11, [[3]])[0][0])


@pytest.mark.parametrize("family", ["bn", "renorm"])
def test_double_backward(family: str) -> None:
    # create_graph=True (gradient penalties): the second derivative of the definition, the earlier
    # micro-batches constants; eager and across DataParallel replicas.
    micro = [x[0] for x in data(12, [[4], [3], [2]])]
    before = make_layer(family)
    w = before.weight.detach().clone().requires_grad_()
    gen = torch.Generator().manual_seed(13)
    for parallel in (False, True):
        layer = make_layer(family)
        model = _after_through(layer)
        with syncbn.accumulation(layer, normalize="cumulative"):
            for t, x in enumerate(micro):
                g, h = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for _ in range(2))
                leaf = x.clone().requires_grad_()
                y = syncbn.parallel.data_parallel(model, leaf) if parallel else model(leaf)
                (dx,) = torch.autograd.grad(y, leaf, g, create_graph=True)
                got = torch.autograd.grad(dx, (leaf, layer.weight), h)
                ref_x = x.clone().requires_grad_()
                ry = definition(family, before, micro[:t], ref_x, w, before.bias.detach())
                (rdx,) = torch.autograd.grad(ry, ref_x, g, create_graph=True)
                want = torch.autograd.grad(rdx, (ref_x, w), h)
                assert _err(dx, rdx) < TOL, (parallel, t)
                for a, b in zip(got, want):
                    assert _err(a, b) < TOL, (parallel, t, _err(a, b))


@pytest.mark.parametrize("sync", [False, True])
def test_inplace_abn_compat_layers(sync: bool) -> None:
    # The inplace-abn drop-ins run the in-place family (local InPlaceABN: the one-process kernel
    # is left for the pooled path; InPlaceABNSync without a group: the same).
    from syncbn.compat.inplace_abn import InPlaceABN, InPlaceABNSync

    cls = InPlaceABNSync if sync else InPlaceABN
    layer = cls(C, activation="leaky_relu", activation_param=SLOPE).double()
    before = make_layer("inplace")
    layer.load_state_dict(before.state_dict())
    micro = [x[0] for x in data(14, [[3], [2], [4]])]
    gen = torch.Generator().manual_seed(15)
    with syncbn.accumulation(layer, normalize="cumulative"):
        for t, x in enumerate(micro):
            g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
            leaf = x.clone().requires_grad_()
            y = layer(leaf * 1.0)
            y.backward(g)
            ry, rdx, _, _ = reference("inplace", before, micro[:t], x, g, slice(None))
            assert _err(y, ry) < TOL and _err(leaf.grad, rdx) < TOL, t
    state = expected_running(before, micro)
    assert _err(layer.running_var, state["running_var"]) < TOL


@needs_compiled_ops
def test_compiled_then_eager_in_one_block() -> None:
    # A layer's calls may change path inside a block (a graph break): the carry serves both.
    layer, before = make_layer("bn"), make_layer("bn")
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(layer, backend=counter, fullgraph=True)
    micro = [x[0] for x in data(16, [[3]] * 4)]
    with syncbn.accumulation(layer, normalize="cumulative"):
        for t, x in enumerate(micro):
            y = (run if t < 2 else layer)(x * 1.0)
            ry, _, _, _ = reference("bn", before, micro[:t], x, torch.zeros_like(x), slice(None))
            assert _err(y, ry) < TOL, t
    assert counter.frame_count == 1
    assert _err(layer.running_var, expected_running(before, micro)["running_var"]) < TOL
