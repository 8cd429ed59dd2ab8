"""End to end: one training step of a ResNet-style CIFAR model on W gloo ranks.

The same model (stem, three stages of two basic blocks, 15 BatchNorm layers)
three times under ``DistributedDataParallel``: with ``syncbn.SyncBatchNorm2d``
(its CPU collectives through shared memory where every rank is on one machine,
the default), with ``syncbn.SyncBatchNorm2d`` on the process group's own
transport (``syncbn-pg``: shared memory off, so gloo), and with plain
``nn.BatchNorm2d`` (unsynchronised: what DDP gives by default). Steps of the
three alternate in one loop; each rank's median step time is taken and the
slowest rank reported, with the ratios to plain (target <= 1.15).

    python benchmarks/e2e.py [--world-size 2] [--batch 16] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from syncbn import SyncBatchNorm2d
from syncbn.cli._launch import run_ranks
from syncbn.cli.bench import machine_info, time_interleaved
from syncbn.groups import ProcessGroupSum


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
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


def resnet(norm: Callable[[int], nn.Module], width: int = 32, classes: int = 10) -> nn.Module:
    """A small ResNet for 32x32 images with 15 normalisation layers."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), norm(width), nn.ReLU()]
    cin = width
    for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
        layers += [BasicBlock(cin, cout, stride, norm), BasicBlock(cout, cout, 1, norm)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=gen)
    y = torch.randint(10, (args.batch,), generator=gen)
    steps: dict[str, Callable[[], Any]] = {}
    on_gloo = ProcessGroupSum(None, shared_memory=False)
    norms: tuple[tuple[str, Callable[[int], nn.Module]], ...] = (
        ("syncbn", SyncBatchNorm2d),
        ("syncbn-pg", lambda c: SyncBatchNorm2d(c, process_group=on_gloo)),
        ("plain", nn.BatchNorm2d),
    )
    for name, norm in norms:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(resnet(norm))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        steps[name] = step
    times = time_interleaved(steps, args.steps, args.warmup, barrier=True, cuda=False)
    mine = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return
    slowest = {k: max(g[k] for g in gathered) for k in mine}
    ratio = slowest["syncbn"] / slowest["plain"]
    ratio_pg = slowest["syncbn-pg"] / slowest["plain"]
    print(
        f"e2e ResNet-style training step, W={world_size} gloo, batch {args.batch}/rank 3x32x32, "
        f"{args.threads} thread(s)/rank, {args.steps} steps: slowest rank's median ms"
    )
    print(
        f"  plain BatchNorm2d {slowest['plain']:8.2f}   syncbn {slowest['syncbn']:8.2f} (ratio {ratio:.3f})"
        f"   syncbn-pg {slowest['syncbn-pg']:8.2f} (ratio {ratio_pg:.3f})"
    )
    if args.json:
        payload = {
            "config": vars(args),
            "machine": machine_info(),
            "median_ms": slowest,
            "per_rank_median_ms": gathered,
            "syncbn_over_plain": ratio,
            "syncbn_pg_over_plain": ratio_pg,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2, default=str)
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="images per rank (default 16)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
