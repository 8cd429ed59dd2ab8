"""torch.compile at model scale: 50 syncbn layers compile once, never per layer, never fall back to eager.

One 2-rank gloo launch runs every case (compiling is slow on 2 cores); its
result is cached for the tests that read it. The graphs are compiled with the
``eager`` backend: recompilation and the traced autograd function (forward and
backward, speculated once per layer: most of this file's CPU time) are dynamo's
matter; AOTAutograd's effect tokens and backward graph run in ``test_compile.py``
(``aot_eager`` and inductor) and inductor's code generation at scale in
``benchmarks/compile/compile_models.py``.

Counted per case, after the warm-up (the first training step and the first
eval call: eval is another graph, as for ``nn.BatchNorm``): graphs compiled (0),
forward and backward collective operator calls (one each per layer per step:
no layer ran eagerly), and the largest difference from eager syncbn (float64).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import _helpers.compiling  # noqa: F401  (the compiler's modules, inherited by the forked ranks)
import syncbn
import syncbn.modules
from _helpers.dist_harness import launch_once
from _helpers.marks import needs_compiled_ops

pytestmark = needs_compiled_ops

BLOCKS = 50
# Per-rank batch sizes of each training step after the warm-up step: changed sizes, uneven ranks.
SIZES = ((3, 2), (2, 4), (4, 3))
# The whole model as one graph, and every layer a frame of its own (a top-level nn.Sequential
# under torch.compile(DDP(m))). compile(DDP(m)) of a whole-model root is in test_compile.py.
CASES = ("DDP(compile(m))", "per-layer frames")


class _Net(nn.Module):
    """The blocks under a root module of its own: dynamo traces the whole model as one frame."""

    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(BLOCKS):
        # The last layer keeps a cumulative average (momentum=None): a traced factor, no host read.
        bn = syncbn.SyncBatchNorm2d(4, momentum=None if i == BLOCKS - 1 else 0.1)
        layers += [nn.Conv2d(4, 4, 3, padding=1, bias=False), bn, nn.ReLU()]
    return nn.Sequential(*layers).double()


def _err(a: Tensor, b: Tensor) -> float:
    """The largest difference, relative to the reference's largest magnitude (at least 1)."""
    if not a.numel():
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / a.abs().max().clamp(min=1.0))


def _layers(model: nn.Module) -> Any:
    return (m for m in model.modules() if isinstance(m, syncbn.SyncBatchNorm))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _op_calls() -> tuple[int, int]:
    from syncbn.engine import _ops

    return _ops.calls, _ops.backward_calls


def _batch(step: int, sizes: tuple[int, int], rank: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    n = sum(sizes)
    X = torch.randn(n, 4, 4, 4, dtype=torch.float64, generator=g) * 2 + 1
    G = torch.randn(n, 4, 4, 4, dtype=torch.float64, generator=g)
    lo = sum(sizes[:rank])
    return X[lo : lo + sizes[rank]], G[lo : lo + sizes[rank]]


def _case(name: str, rank: int) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    body = _blocks()
    eager_m = _Net(body) if name != "per-layer frames" else body
    comp_m = copy.deepcopy(eager_m)
    eager: nn.Module = nn.parallel.DistributedDataParallel(eager_m)
    compiled: nn.Module
    if name == "compile(DDP(m))":
        compiled = torch.compile(nn.parallel.DistributedDataParallel(comp_m), backend="eager")
    elif name == "DDP(compile(m))":
        compiled = nn.parallel.DistributedDataParallel(torch.compile(comp_m, backend="eager"))
    else:
        # A top-level nn.Sequential under torch.compile(DDP(m)): dynamo skips the Sequential's
        # frame (torch code) and compiles every syncbn layer as a frame of its own, 50 layers on
        # one code object and one cache. dynamic=True: those frames' inputs are not the marked
        # model input.
        ddp = nn.parallel.DistributedDataParallel(comp_m)
        compiled = torch.compile(ddp, backend="eager", dynamic=True)

    def step(i: int, sizes: tuple[int, int]) -> float:
        x, gy = _batch(i, sizes, rank)
        worst = 0.0
        outs = []
        for model in (eager, compiled):
            xi = x.clone().requires_grad_()
            torch._dynamo.mark_dynamic(xi, 0)  # the per-rank batch size changes
            y = model(xi)
            y.backward(gy)
            outs.append((y, xi.grad))
        # Parameters stay as they are (deep nets amplify rounding differences step after step);
        # the running statistics move every step, and both models' gradients are compared.
        for a, b in zip(eager_m.parameters(), comp_m.parameters()):
            worst = max(worst, _err(a.grad, b.grad))
            a.grad = b.grad = None
        worst = max(worst, _err(outs[0][0], outs[1][0]), _err(outs[0][1], outs[1][1]))
        return max(
            worst, *(_err(a, b) for a, b in zip(eager_m.state_dict().values(), comp_m.state_dict().values()))
        )

    def evaluate() -> float:
        x, _ = _batch(99, (2, 2), rank)
        for m in (eager, compiled):
            m.eval()
        with torch.no_grad():
            worst = _err(eager(x), compiled(x))
        for m in (eager, compiled):
            m.train()
        return worst

    worst = max(step(0, (2, 3)), evaluate())  # warm-up: the training graph and the eval graph
    graphs, (fwd, bwd) = _graphs(), _op_calls()
    for i, sizes in enumerate(SIZES, start=1):
        worst = max(worst, step(i, sizes))
        if i == 1:
            worst = max(worst, evaluate())
    fwd_after, bwd_after = _op_calls()
    return {
        "graphs after warm-up": _graphs() - graphs,
        "forward calls": fwd_after - fwd,
        "backward calls": bwd_after - bwd,
        "worst": worst,
        "num_batches_tracked": int(next(_layers(comp_m)).num_batches_tracked),
    }


def _distributed(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    out = {name: _case(name, rank) for name in CASES}
    dist.barrier()
    return out


def _results() -> list[dict[str, Any]]:
    return launch_once(_distributed, 2, timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fifty_layers_compile_once_and_run_compiled(case: str) -> None:
    for rank, results in enumerate(_results()):
        result = results[case]
        assert result["graphs after warm-up"] == 0, (rank, result)
        # One forward and one backward collective per layer per step, all through the operator.
        assert result["forward calls"] == BLOCKS * len(SIZES), (rank, result)
        assert result["backward calls"] == BLOCKS * len(SIZES), (rank, result)
        assert result["num_batches_tracked"] == 1 + len(SIZES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fifty_layers_compiled_equal_eager(case: str) -> None:
    for rank, results in enumerate(_results()):
        assert results[case]["worst"] <= 1e-10, (rank, results[case])
