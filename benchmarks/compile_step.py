"""Compiled vs eager training step of a small Conv-SyncBatchNorm-ReLU network under DDP, 2 gloo ranks.

    python benchmarks/compile_step.py [--steps 30] [--batch 16] [--threads 1]

Prints the slowest rank's median step time (forward, backward, SGD step) for
eager DDP and for ``torch.compile(DDP(model))``, after warm-up (compilation
time excluded, reported separately). CPU, float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _model() -> nn.Module:
    import syncbn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 32, 64):
        conv = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        layers += [conv, syncbn.SyncBatchNorm2d(width), nn.ReLU()]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def _worker(rank: int, world: int, tmp: str, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))
    result = {}
    for name in ("eager", "compiled"):
        ddp = nn.parallel.DistributedDataParallel(_model())
        model = torch.compile(ddp) if name == "compiled" else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step() -> None:
            nn.functional.cross_entropy(model(x), y).backward()  # noqa: B023
            opt.step()  # noqa: B023
            opt.zero_grad()  # noqa: B023

        start = time.perf_counter()
        for _ in range(3):
            step()
        result[f"{name} warm-up s"] = time.perf_counter() - start
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        result[name] = statistics.median(times) * 1e3
    out[rank] = result
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(2, tmp, args, out), nprocs=2, start_method="fork")
        results = dict(out)
    print(f"W=2 gloo cpu float32, batch {args.batch}x3x32x32 per rank, {args.threads} thread(s)/rank")
    slowest = {key: max(r[key] for r in results.values()) for key in ("eager", "compiled")}
    for key, ms in slowest.items():
        print(f"{key:>9}: {ms:8.2f} ms/step (slowest rank's median)")
    print(f"  speedup: {slowest['eager'] / slowest['compiled']:.2f}x")
    print(f"  compile warm-up (3 steps): {max(r['compiled warm-up s'] for r in results.values()):.1f} s")


if __name__ == "__main__":
    main()
