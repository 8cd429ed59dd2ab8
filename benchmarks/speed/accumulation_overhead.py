"""What ``syncbn.accumulation`` costs: per micro-batch, with and without the block, on 2 gloo ranks.

    python benchmarks/speed/accumulation_overhead.py [--layers 8] [--shape 8x32x8x8] [--steps 60]

Prints the median time of one training micro-batch (forward + backward of a stack of
``SyncBatchNorm2d`` layers) outside any block and inside a block (committed every 4
micro-batches), the commit's own time per layer, and the hook's cost in isolation: ``observe``
with no block open, and one micro-batch's ``Moments.add`` (the copy the block keeps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

import syncbn
from syncbn import _accumulating
from syncbn.cli._launch import run_ranks


def _model(layers: int, channels: int) -> nn.Module:
    return nn.Sequential(*[syncbn.SyncBatchNorm2d(channels) for _ in range(layers)])


def _rank(rank: int, world: int, layers: int, shape: list[int], steps: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = _model(layers, shape[1])
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)

    def step() -> float:
        start = time.perf_counter()
        model(x).backward(grad)
        return time.perf_counter() - start

    for _ in range(10):
        step()
    plain, inside, commits = [], [], []
    for _ in range(steps // 4):
        plain += [step() for _ in range(4)]
        block = syncbn.accumulation(model).begin()
        inside += [step() for _ in range(4)]
        start = time.perf_counter()
        block.commit()
        commits.append((time.perf_counter() - start) / layers)
    return {
        "plain_ms": statistics.median(plain) * 1e3,
        "inside_ms": statistics.median(inside) * 1e3,
        "commit_us_per_layer": statistics.median(commits) * 1e6,
    }


def _hook_costs(channels: int) -> dict[str, float]:
    running = torch.zeros(channels)
    mean, var = torch.randn(channels), torch.rand(channels)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        _accumulating.observe(running, 12.0, mean, var, 0.1)
    idle = (time.perf_counter() - start) / n
    moments = _accumulating.Moments(running)
    start = time.perf_counter()
    for _ in range(2000):
        moments.add(12.0, mean, var)
    add = (time.perf_counter() - start) / 2000
    return {"observe_idle_ns": idle * 1e9, "add_us": add * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shape", default="8x32x8x8")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    shape = [int(v) for v in args.shape.split("x")]
    torch.set_num_threads(1)
    hook = _hook_costs(shape[1])
    result = run_ranks(_rank, 2, "gloo", args.layers, shape, args.steps)
    extra = (result["inside_ms"] - result["plain_ms"]) / args.layers * 1e3
    print(f"{args.layers} x SyncBatchNorm2d, input {args.shape} per rank, 2 gloo ranks, 1 thread each")
    print(f"  micro-batch outside a block : {result['plain_ms']:.2f} ms (median)")
    print(f"  micro-batch inside a block  : {result['inside_ms']:.2f} ms ({extra:+.1f} us per layer)")
    print(f"  commit                      : {result['commit_us_per_layer']:.0f} us per layer, once per step")
    print(f"  observe, no block open      : {hook['observe_idle_ns']:.0f} ns per layer call")
    print(f"  Moments.add (eager)         : {hook['add_us']:.1f} us per layer and micro-batch")


if __name__ == "__main__":
    main()
