"""CmBN: ``syncbn.accumulation(model, normalize="cumulative")`` against its definition.

Micro-batch t of a block is normalised with the count, mean and biased variance of micro-batches
1..t of all ranks, the earlier ones constants. The reference is computed by hand in float64 on
the concatenation ``cat(x_1.detach(), ..., x_{t-1}.detach(), x_t)`` of the global micro-batches,
keeping the rows of micro-batch t (this rank's share), with a random upstream gradient: output,
input gradient, weight and bias gradients (summed over the block), and the running statistics
after the block (``nn.BatchNorm`` once on every micro-batch together).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import syncbn

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


def reference(
    family: str, layer: nn.Module, earlier: list[Tensor], x: Tensor, grad: Tensor, rows: slice
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, dx, dweight, dbias)`` of this rank's ``rows`` of the global micro-batch ``x``, by the
    definition; ``grad``: every rank's upstream gradient (the weight and bias ones stay local)."""
    x = x.detach().clone().requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
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
    if family == "inplace":
        y = F.leaky_relu(y, SLOPE)
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
) -> dict[str, float]:
    """One cumulative block over ``shards[t][r]`` on this rank: the worst error of each quantity.

    ``call(model, x)`` runs the model (default: a plain call); ``module`` wraps the layer (DDP).
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
