"""The collective seam other layers may use: ``syncbn.engine._ops.all_reduce_sum`` (docs/works-with.md).

A layer of the user's own (a "sum of squares" normaliser) calls it in its forward: on 2 gloo
ranks, eagerly and under ``torch.compile(fullgraph=True)``, the result is the sum over the
ranks, with the first-use handshake of the layer, one framed collective per call, and no graph
break. (``syncbn.engine._ops`` needs ordered effectful custom operators: on torch without them the
seam is not there, and these tests skip.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from _helpers.dist_harness import launch
from _helpers.marks import needs_compiled_ops
from syncbn import _checks

pytestmark = needs_compiled_ops


class _RankNorm(nn.Module):
    """Divides by the root of the group's mean square per channel: one collective per call."""

    def __init__(self) -> None:
        super().__init__()
        self._syncbn_state = _checks.LayerState()
        self._syncbn_state.bind(self)

    def forward(self, x: Tensor) -> Tensor:
        from syncbn.engine import _ops

        packed = torch.cat([x.new_full((1,), x.shape[0]), x.square().sum(0)])
        total = _ops.all_reduce_sum(packed, None, self, "forward", source=x)
        return x / (total[1:] / total[0]).sqrt()


def _seam(rank: int, world_size: int) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    sizes = (3, 5)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    x = full[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
    expected = x / full.square().mean(0).sqrt()
    layer = _RankNorm()
    out = {"eager": (layer(x) - expected).abs().max().item()}
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for _ in range(2):
        out["compiled"] = (compiled(x) - expected).abs().max().item()
    out["frames"] = counter.frame_count
    return out


def test_other_layers_sum_through_the_seam_eagerly_and_compiled_without_graph_break() -> None:
    for result in launch(_seam, 2, timeout=120):
        assert result["eager"] < 1e-12, result
        assert result["compiled"] < 1e-12 and result["frames"] == 1, result


class _Doubling:
    """A loopback group standing for two ranks holding the same values: the sum doubles."""

    size, rank = 2, 0

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t.mul_(2)


def test_the_operator_is_its_own_adjoint_and_never_aliases_its_input() -> None:
    from syncbn import groups
    from syncbn.engine import _ops

    group = _Doubling()
    handle = _ops.group_handle(group)
    op = torch.ops.syncbn.all_reduce_sum.default
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, dtype=torch.float64)
    before = x.detach().clone()
    calls, backward_calls = _ops.calls, _ops.backward_calls
    out = op(x, handle, None, groups.PHASE_FORWARD, None, 0)
    out.backward(g)
    assert torch.equal(out.detach(), 2 * before) and torch.equal(x.detach(), before)
    assert out.data_ptr() != x.data_ptr()
    assert x.grad is not None and torch.equal(x.grad, 2 * g)  # the adjoint: one more sum
    assert (_ops.calls - calls, _ops.backward_calls - backward_calls) == (1, 1)
    with torch.no_grad():  # no gradient recorded: straight to the sum, a new tensor
        plain = op(before, handle, None, groups.PHASE_OTHER, None, 0)
    assert torch.equal(plain, 2 * before) and plain.data_ptr() != before.data_ptr()


def test_the_operator_has_fake_and_meta_kernels_that_run_no_collective() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from syncbn import groups
    from syncbn.engine import _ops

    handle = _ops.group_handle(_Doubling())
    op = torch.ops.syncbn.all_reduce_sum.default
    calls = _ops.calls
    meta = op(torch.empty(3, 4, device="meta").t(), handle, None, groups.PHASE_FORWARD, None, 0)
    assert meta.device.type == "meta" and meta.shape == (4, 3) and meta.is_contiguous()
    with FakeTensorMode():
        fake = op(torch.empty(3, 4).t(), handle, None, groups.PHASE_FORWARD, None, 0)
    assert fake.shape == (4, 3) and fake.is_contiguous()
    assert _ops.calls == calls


def test_the_compiled_operator_is_differentiated_through_its_adjoint_with_every_call_kept() -> None:
    import torch._dynamo

    from syncbn import groups
    from syncbn.engine import _ops

    group = _Doubling()  # held: the operator finds its group through a weak reference
    handle = _ops.group_handle(group)

    def f(x: Tensor, w: Tensor) -> Tensor:
        summed = _ops._all_reduce_op(x * x, handle, None, groups.PHASE_FORWARD, None, 0)
        _ops._all_reduce_op(x, handle, None, groups.PHASE_FORWARD, None, 0)  # unused: still runs
        return (summed * w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    w = torch.randn(6, dtype=torch.float64)
    for _ in range(2):
        x = torch.randn(6, dtype=torch.float64, requires_grad=True)
        calls, backward_calls = _ops.calls, _ops.backward_calls
        loss = compiled(x, w)
        loss.backward()
        assert torch.allclose(loss, 2 * (x.detach() ** 2 * w).sum())
        assert x.grad is not None and torch.allclose(x.grad, 2 * x.detach() * 2 * w)
        assert (_ops.calls - calls, _ops.backward_calls - backward_calls) == (2, 1)
    torch._dynamo.reset()
