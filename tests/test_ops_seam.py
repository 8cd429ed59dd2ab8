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
