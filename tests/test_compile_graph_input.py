"""torch.compile of a layer whose input is a graph INPUT (the compiled module is the layer itself).

An in-place layer then writes over a tensor the compiled graph receives: functionalisation must
carry the write back into it, and its gradient must be the layer's. On torch 2.13 a compiled
Function that marks its input dirty gave that input the upstream gradient unchanged (relative error
about 3 of the largest gradient, in float64): the regression these tests guard. Every family, both
placements of the input (a graph input, and produced inside the graph), on 2 gloo ranks with uneven
batches; float64 against nn.BatchNorm + activation on the global batch (the in-place family) or the
eager layer on the same shard (batch norm, renorm), random upstream gradients. One launch runs every
case (compiling is slow on 2 cores), in child processes (a compiled backward in the test process
breaks the ranks later tests fork from it, see tests/test_compile.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import _helpers.compiling  # noqa: F401  (the compiler's modules, inherited by the forked ranks)
import syncbn
from _helpers.abn_reference import max_error, reference
from _helpers.dist_harness import launch_once
from _helpers.marks import needs_compiled_ops

pytestmark = needs_compiled_ops

C, H, W = 3, 2, 3
SIZES = (3, 5)  # per-rank batch sizes: uneven
SLOPE = 0.01
TOL = 1e-10  # float64; relative to max(1, |reference|)


class _Inside(nn.Module):
    """The layer's input produced inside the compiled graph (``layer(x * 1)``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x * 1)


class _Discarded(nn.Module):
    """The in-place layer's return value unused: the overwritten tensor carries its output on."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        t = x * 1
        self.layer(t)
        return t * 2


def _make(family: str, gen: torch.Generator, training: bool) -> nn.Module:
    if family == "inplace":
        layer: nn.Module = syncbn.InPlaceSyncBatchNorm2d(C, activation="leaky_relu", activation_param=SLOPE)
    elif family == "renorm":
        layer = syncbn.SyncBatchRenorm2d(C, r_max=1.5, d_max=0.5)
    else:
        layer = syncbn.SyncBatchNorm2d(C)
    layer = layer.double().train(training)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(C, generator=gen, dtype=torch.float64) - 0.5)  # signs of both kinds
        layer.bias.copy_(torch.randn(C, generator=gen, dtype=torch.float64))
        layer.running_mean.copy_(torch.randn(C, generator=gen, dtype=torch.float64))
        layer.running_var.copy_(torch.rand(C, generator=gen, dtype=torch.float64) + 0.5)
    return layer


def _case(rank: int, family: str, placement: str, backend: str, training: bool, seed: int) -> float:
    """The worst relative error of output, input/weight/bias gradients and running statistics."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed)
    layer = _make(family, gen, training)
    eager = copy.deepcopy(layer)
    before = (layer.running_mean.clone(), layer.running_var.clone())
    x = torch.randn(sum(SIZES), C, H, W, generator=gen, dtype=torch.float64) * 1.5 + 3.0
    g = torch.randn(sum(SIZES), C, H, W, generator=gen, dtype=torch.float64)
    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    wrapped = {"graph input": layer, "inside": _Inside(layer), "discarded": _Discarded(layer)}[placement]
    run = torch.compile(wrapped, backend=backend, fullgraph=True)
    x_leaf = x[start:stop].clone().requires_grad_()
    x_in = x_leaf * 1  # a non-leaf the layer may overwrite (a graph input when placement is that)
    if backend == "inductor":  # one kernel source for both ranks' batches (3, 5): compiled once, not
        torch._dynamo.mark_dynamic(x_in, 0)  # per rank; the write-back and gradients do not depend on it
    y = run(x_in)
    y.backward(g[start:stop])
    errors = []
    if family == "inplace" and placement == "graph input":  # written over its input, as eager does
        errors.append(max_error(x_in, y))
    if family == "inplace":  # float64 nn.BatchNorm (weight |w| + eps) + leaky_relu on the global batch
        factor = 2.0 if placement == "discarded" else 1.0
        ref = reference(x, g * factor, eager.weight, eager.bias, before, training=training, param=SLOPE)
        expected = (ref["y"][start:stop] * factor, ref["dx"][start:stop], ref["dw"], ref["db"])
        expected_running = (ref["rm"], ref["rv"])
    else:  # the eager layer on the same shard
        x_eager = x[start:stop].clone().requires_grad_()
        y_eager = eager(x_eager * 1)
        y_eager.backward(g[start:stop])
        grads = [p.grad.clone() for p in (eager.weight, eager.bias)]
        for grad in grads:
            dist.all_reduce(grad)
        expected = (y_eager, x_eager.grad, *grads)
        expected_running = (eager.running_mean, eager.running_var)
    weight_grad, bias_grad = layer.weight.grad.clone(), layer.bias.grad.clone()
    for grad in (weight_grad, bias_grad):  # the global batch's parameter gradients: the ranks' sum
        dist.all_reduce(grad)
    got = (y, x_leaf.grad, weight_grad, bias_grad)
    errors += [max_error(a, b) for a, b in zip(got, expected)]
    errors += [max_error(a, b) for a, b in zip((layer.running_mean, layer.running_var), expected_running)]
    return max(errors)


def _leaf_refused(rank: int) -> dict[str, Any]:
    """A leaf that requires grad handed to the compiled in-place layer: eager's error, nothing changed."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    layer = _make("inplace", gen, True)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(SIZES[rank], C, H, W, generator=gen, dtype=torch.float64, requires_grad=True)
    before = x.detach().clone()
    try:
        torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
        text = ""
    except RuntimeError as exc:
        text = str(exc)
    after = layer.state_dict()
    unchanged = torch.equal(x.detach(), before) and all(torch.equal(v, after[k]) for k, v in state.items())
    return {"error": text, "unchanged": unchanged}


CASES = [
    ("inplace", "graph input", "aot_eager", True),
    ("inplace", "inside", "aot_eager", True),
    ("inplace", "discarded", "aot_eager", True),
    ("inplace", "graph input", "aot_eager", False),
    ("inplace", "graph input", "inductor", True),
    ("batchnorm", "graph input", "aot_eager", True),
    ("batchnorm", "inside", "aot_eager", True),
    ("renorm", "graph input", "aot_eager", True),
    ("renorm", "inside", "aot_eager", True),
]


def _all_cases(rank: int, world_size: int) -> dict[Any, Any]:
    results: dict[Any, Any] = {case: _case(rank, *case, seed=i) for i, case in enumerate(CASES)}
    results["leaf"] = _leaf_refused(rank)
    return results


def _results() -> list[dict[Any, Any]]:
    return launch_once(_all_cases, 2, timeout=580)


def _id(case: tuple[Any, ...]) -> str:
    family, placement, backend, training = case
    return f"{family}-{placement.replace(' ', '_')}-{backend}-{'train' if training else 'eval'}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_compiled_layer_on_a_graph_input_or_inside_the_graph_is_exact(case: tuple[Any, ...]) -> None:
    for rank, result in enumerate(_results()):
        assert result[case] <= TOL, f"rank {rank}: {_id(case)} differs by {result[case]:.3g}"


@pytest.mark.timeout(600)
def test_compiled_in_place_layer_refuses_a_leaf_that_requires_grad_as_eager_does() -> None:
    for rank, result in enumerate(_results()):
        assert "overwrites its input" in result["leaf"]["error"], f"rank {rank}: {result['leaf']}"
        assert "leaf tensor that requires grad" in result["leaf"]["error"]
        assert result["leaf"]["unchanged"], f"rank {rank}: the input or the layer's state changed"
