"""The end-to-end training steps of ``syncbn bench`` and ``benchmarks/`` (docs/internals/cli.md)."""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import SyncBatchNorm2d
from ._bench_runner import time_interleaved
from ._launch import gather

__all__ = ["MODELS", "conv_net", "deep_narrow", "resnet", "sgd_step", "time_steps", "format_e2e", "slowest"]

Norm = Callable[[int], nn.Module]


class _Rooted(nn.Module):
    """A root module, so that dynamo traces the whole model (it skips a top-level ``nn.Sequential``)."""

    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def conv_net(norm: Norm, widths: tuple[int, ...]) -> nn.Module:
    """One conv3x3-norm-ReLU block per width, global pooling and a linear head (10 classes)."""
    layers: list[nn.Module] = []
    cin = 3
    for width in widths:
        layers += [nn.Conv2d(cin, width, 3, 1, 1, bias=False), norm(width), nn.ReLU()]
        cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return _Rooted(nn.Sequential(*layers))


def deep_narrow(norm: Norm) -> nn.Module:
    """The narrow net: 24 conv3x3(32)-norm-ReLU blocks, global pooling and a linear head."""
    return conv_net(norm, (32,) * 24)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet(norm: Norm, width: int = 32) -> nn.Module:
    """A small ResNet for 32x32 images with 15 normalisation layers (10 classes)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), norm(width), nn.ReLU()]
    cin = width
    for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
        layers += [_BasicBlock(cin, cout, stride, norm), _BasicBlock(cout, cout, 1, norm)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def sgd_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, compiled: bool = False) -> Callable[[], None]:
    """One SGD step (lr 0.01, momentum 0.9) of ``net``, compiled with ``compiled``, on ``x``, ``y``."""
    model: Callable[[torch.Tensor], torch.Tensor] = torch.compile(net) if compiled else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


#: name -> (model factory, per-rank input size HxW, description)
MODELS: dict[str, tuple[Callable[[Norm], nn.Module], int, str]] = {
    "deep": (deep_narrow, 8, "24 conv3x3(32)-BN-ReLU blocks, 8x8 images"),
    "wide": (partial(conv_net, widths=(16, 32, 32, 64)), 32, "4 conv3x3(16-64)-BN-ReLU blocks, 32x32 images"),
    "resnet": (resnet, 32, "ResNet-style, 15 BN layers, 32x32 images"),
}


def time_steps(
    model: str,
    rank: int,
    batch: int,
    steps: int,
    warmup: int,
    norms: dict[str, Norm] | None = None,
    *,
    compiled: bool = False,
    device: torch.device | None = None,
    first_s: dict[str, float] | None = None,
) -> dict[str, float]:
    """This rank's median DDP step (ms) of ``model`` per normalisation (default syncbn, plain BN); collective.

    ``compiled``: ``torch.compile(DDP(model))``; ``first_s`` receives each first step's seconds.
    """
    build, size, _ = MODELS[model]
    device = device or torch.device("cpu")
    norms = norms or {"syncbn": SyncBatchNorm2d, "plain": nn.BatchNorm2d}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, size, size, generator=gen).to(device)
    y = torch.randint(10, (batch,), generator=gen).to(device)
    cuda = device.type == "cuda"
    first_s = {} if first_s is None else first_s
    fns: dict[str, Callable[[], Any]] = {}
    for name, norm in norms.items():
        torch.manual_seed(0)
        ids = [device.index] if cuda else None
        ddp = nn.parallel.DistributedDataParallel(build(norm).to(device), device_ids=ids)
        fns[name] = sgd_step(ddp, x, y, compiled)
        first_s[name] = time_interleaved({name: fns[name]}, 1, 0, barrier=True, cuda=cuda)[name][0]
    times = time_interleaved(fns, steps, warmup, barrier=True, cuda=cuda)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def slowest(mine: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Every rank's ``mine`` gathered; per key, the largest value over the ranks (collective)."""
    gathered = gather(mine)
    return {k: max(g[k] for g in gathered) for k in mine}, gathered


def format_e2e(model: str, ms: dict[str, float]) -> str:
    """One line: each variant's slowest-rank median and its ratio to ``plain``."""
    parts = [f"plain {ms['plain']:.2f} ms"] + [
        f"{name} {value:.2f} ms (x{value / ms['plain']:.3f})" for name, value in ms.items() if name != "plain"
    ]
    return f"  {model:>6} ({MODELS[model][2]}): " + "   ".join(parts)
