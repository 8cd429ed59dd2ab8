"""The statistics hook (``Params.statistics``, syncbn.families._protocol.Statistics).

A hook that pools the call's summed moments with constant sums of an earlier batch ``x0``
(CmBN's shape) gives, on the eager, torch.func and traced paths and for the in-place family,
the definition: statistics over ``x0`` and ``x`` together, the gradient reaching ``x`` only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from syncbn.engine import _compiled
from syncbn.engine._function import LOCAL, Params, apply
from syncbn.families._protocol import THIS_CALL
from syncbn.families.inplace_abn import InPlaceABN

EPS = 1e-5


class _Pooled:
    """Adds the constant packed sums ``[n0, sum x0, sum x0^2]`` of an earlier batch; counts its calls."""

    def __init__(self, x0: torch.Tensor) -> None:
        dims = [0, *range(2, x0.dim())]
        n0 = torch.tensor([x0.numel() / x0.shape[1]], dtype=torch.float64)
        self.prev = torch.cat([n0, x0.sum(dims), (x0 * x0).sum(dims)]).detach()
        self.calls = 0

    def pool(self, packed: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return packed + self.prev.to(packed.device)


def _reference(x, x0, weight, bias):
    """Normalised with the statistics of ``x0`` and ``x`` together, ``x0`` a constant (float64)."""
    dims, shape = [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)
    n = (x.numel() + x0.numel()) / x.shape[1]
    mean = (x0.sum(dims) + x.sum(dims)) / n
    var = ((x0 * x0).sum(dims) + (x * x).sum(dims)) / n - mean * mean
    xhat = (x - mean.view(shape)) / (var + EPS).sqrt().view(shape)
    return xhat * weight.view(shape) + bias.view(shape)


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    x0 = torch.randn(3, 4, 5, dtype=torch.float64) * 2 + 1
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    return x0, x, w, b, torch.randn(2, 4, 5, dtype=torch.float64)


def _grads(y, g, tensors):
    return torch.autograd.grad(y, tensors, g)


def _check(run, leaves=True):
    x0, x, w, b, g = _inputs()
    pooled = _Pooled(x0)
    y = run(x, w, b, pooled)
    ref = _reference(x, x0, w, b)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    assert pooled.calls == 1
    for got, want in zip(_grads(y, g, (x, w, b)), _grads(ref, g, (x, w, b))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_default_is_this_call() -> None:
    assert Params(None, None, EPS, 0.1).statistics is THIS_CALL
    packed = torch.arange(5.0, dtype=torch.float64)
    assert THIS_CALL.pool(packed) is packed


def test_eager_pools() -> None:
    _check(lambda x, w, b, s: apply(x, w, b, Params(None, None, EPS, 0.1, LOCAL, statistics=s)))


def test_torch_func_pools() -> None:
    x0, x, w, b, g = _inputs()
    pooled = _Pooled(x0)

    def loss(x, w, b, stats):
        return (apply(x, w, b, Params(None, None, EPS, 0.1, LOCAL, statistics=stats)) * g).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b, pooled)
    want = _grads(_reference(x, x0, w, b), g, (x, w, b))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_traced_pools() -> None:
    _check(
        lambda x, w, b, s: _compiled.sync_batch_norm(x, w, b, Params(None, None, EPS, 0.1, 0, statistics=s))
    )


def test_running_update_takes_the_pooled_statistics() -> None:
    x0, x, w, b, _ = _inputs()
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    apply(x.detach(), None, None, Params(rm, rv, EPS, 1.0, LOCAL, statistics=_Pooled(x0)))
    both = torch.cat([x0, x.detach()])
    torch.testing.assert_close(rm, both.mean((0, 2)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rv, both.transpose(0, 1).reshape(4, -1).var(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["leaky_relu", "identity"])
def test_in_place_family_pools(activation) -> None:
    x0, x, w, b, g = _inputs()
    pooled = _Pooled(x0)
    family = InPlaceABN(activation, 0.1)
    src = x.detach().clone().requires_grad_()
    y = apply(src * 1.0, w, b, Params(None, None, EPS, 0.1, LOCAL, None, family, pooled))
    z = _reference(src, x0, w.abs() + EPS, b)
    ref = F.leaky_relu(z, 0.1) if activation == "leaky_relu" else z
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    assert pooled.calls == 1
    for got, want in zip(_grads(y, g, (src, w, b)), _grads(ref, g, (src, w, b))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
