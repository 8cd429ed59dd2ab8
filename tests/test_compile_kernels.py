"""Kernels per layer of the compiled path, counted in inductor's generated code (never timed).

A compiled ``nn.BatchNorm2d`` training step runs one generated kernel per layer each way: the
statistics and the normalisation (forward), the reductions and the input gradient (backward)
are loops of one kernel. syncbn's traced layer has its collective, an opaque operator, between
the reduction and the elementwise pass that reads the sum, so each way it needs one kernel
before and one after it: one more than ``nn.BatchNorm2d`` per layer each way, and no more (the
local reduction cannot fuse with the convolution that produces the input, an external kernel,
nor the normalisation with the one that consumes it). Where the producer and the consumer are
generated kernels themselves (pointwise operations), they fuse into syncbn's two kernels as into
``nn.BatchNorm2d``'s one: the collective is the only boundary. See benchmarks/RESULTS.md, issue 42.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import syncbn
from syncbn.cli._bench_e2e import conv_net

pytest.importorskip("torch._inductor.utils")
from torch._inductor.utils import run_and_get_code  # noqa: E402

# A generated kernel's launch inside a compiled graph's ``call`` (CPU: C++; GPU: Triton).
_LAUNCH = re.compile(r"^\s+(?:cpp_fused_\w+\(|\w+\.run\()", re.M)
_COLLECTIVE = re.compile(r"torch\.ops\.syncbn\.all_reduce_sum\.default\(")


class _Loopback:
    """Two members whose sum is the identity: the synchronised compiled path in one process."""

    size, rank = 2, 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _launches(norm: Any, blocks: int) -> list[tuple[int, int]]:
    """Per compiled graph (forward, then backward): (kernel launches, collective calls) of one step."""
    torch.manual_seed(0)
    net = conv_net(norm, (8,) * blocks)
    x = torch.randn(4, 3, 8, 8)
    torch._dynamo.reset()
    model = torch.compile(net)
    _, codes = run_and_get_code(lambda: model(x).sum().backward())
    return [(len(_LAUNCH.findall(code)), len(_COLLECTIVE.findall(code))) for code in codes]


@pytest.mark.timeout(600)
def test_compiled_layer_runs_one_kernel_either_side_of_each_collective() -> None:
    blocks = 2
    loop = _Loopback()
    plain = _launches(nn.BatchNorm2d, blocks)
    ours = _launches(lambda c: syncbn.SyncBatchNorm2d(c, process_group=loop), blocks)
    assert len(plain) == len(ours) == 2  # a forward and a backward graph
    for (bn_kernels, bn_collectives), (kernels, collectives) in zip(plain, ours):
        assert bn_collectives == 0 and collectives == blocks  # one collective per layer each way
        # nn.BatchNorm2d: one kernel per layer (plus the step's own); syncbn: one more per layer,
        # the kernel boundary the opaque collective makes, and nothing else.
        assert kernels == bn_kernels + blocks, (plain, ours)


class _Pointwise(nn.Module):
    """A norm between pointwise operations: no external kernel on either side of it."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.norm = norm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * 2.0 + 1.0).relu() * 3.0


def _pointwise_launches(norm: Any) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 8, 8, requires_grad=True)
    torch._dynamo.reset()
    model = torch.compile(_Pointwise(norm))
    _, codes = run_and_get_code(lambda: model(x).sum().backward())
    return [(len(_LAUNCH.findall(code)), len(_COLLECTIVE.findall(code))) for code in codes]


@pytest.mark.timeout(600)
def test_compiled_layer_fuses_with_its_pointwise_producer_and_consumer() -> None:
    plain = _pointwise_launches(nn.BatchNorm2d)
    ours = _pointwise_launches(lambda c: syncbn.SyncBatchNorm2d(c, process_group=_Loopback()))
    # nn.BatchNorm2d: producer, statistics, normalisation, ReLU and scaling in one kernel each way;
    # syncbn: the same operations in two, split only by its one collective each way.
    assert plain == [(1, 0), (1, 0)], plain
    assert ours == [(2, 1), (2, 1)], ours
