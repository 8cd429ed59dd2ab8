"""How low a synchronised layer can go from Python: the floor under syncbn's per-layer cost.

W gloo ranks on one machine run, for each shape, in tight loops (one barrier per
block of steps, not per step, so the barrier's exit skew is not charged to the
synchronised methods), interleaved block by block:

* ``bn``: unsynchronised ``nn.BatchNorm`` forward + backward (the baseline);
* ``py-floor``: a minimal Python ``torch.autograd.Function`` that calls the two
  native kernels nn.BatchNorm calls (``native_batch_norm`` training forward and
  its backward) and nothing else: no synchronisation at all. What any
  pure-Python synchronised layer pays before it does any work of its own;
* ``own``: ``syncbn.SyncBatchNorm`` over a group whose sum is the identity: all
  of syncbn's own per-call work (module, autograd function, math), no
  collective, no waiting;
* ``2rounds``: the two shared-memory all_reduces a layer needs (``2C + 1`` and
  ``2C`` values through :class:`syncbn.groups.ProcessGroupSum`), back to back,
  with no compute between them: their latency between real processes;
* ``fused``: what a compiled (fused-kernel) syncbn could cost from Python, with
  the lockstep: one native kernel either side of each of the layer's two
  collectives, in a minimal autograd function (:mod:`syncbn.cli._bench_methods`, the floor ``syncbn bench``
  measures for its nets);
* ``syncbn``: ``syncbn.SyncBatchNorm`` forward + backward over the group.

``fused / bn`` is the best a compiled kernel could do here. ``floor = (py-floor +
2rounds) / bn`` is what a layer built from a Python autograd function and two
collectives costs at best against unsynchronised nn.BatchNorm; ``syncbn / bn`` is
what it costs now, and ``syncbn - own - 2rounds`` (``lockstep``) what the ranks
lose waiting for each other at a layer's two collectives beyond the collectives'
own latency. Each rank's median per block, the slowest rank's value, then the
median over blocks::

    python benchmarks/speed/floor.py [--shapes 64x128,8x32x8x8,256x512] [--steps 100] [--blocks 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import syncbn
from syncbn import groups
from syncbn.cli._bench_methods import TAGS, FusedBound, collective_buffers
from syncbn.cli._launch import run_ranks


class _Identity:
    """A two-member group whose sum is the identity: syncbn's own work without any collective."""

    size, rank = 2, 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


class _NativeOnly(torch.autograd.Function):
    """nn.BatchNorm's two native kernels inside a Python autograd function: the floor, no sync."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor
    ) -> Tensor:
        out, mean, invstd = torch.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, 0.1, 1e-5
        )
        ctx.save_for_backward(x, weight, mean, invstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, None, None, mean, invstd, True, 1e-5, [True, True, True]
        )
        return gx, gw, gb, None, None


def _steps(shape: tuple[int, ...], group: groups.ProcessGroupSum) -> dict[str, Callable[[], None]]:
    channels = shape[1]
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(shape, generator=gen).requires_grad_(True)
    dy = torch.randn(shape, generator=gen)
    kind = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    bn = kind(channels)
    sbn = syncbn.SyncBatchNorm(channels)
    own = syncbn.SyncBatchNorm(channels, process_group=_Identity())
    weight = torch.ones(channels, requires_grad=True)
    bias = torch.zeros(channels, requires_grad=True)
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)
    sums = fwd, bwd = collective_buffers(channels)

    def step_bn() -> None:
        bn(x).backward(dy)

    def step_floor() -> None:
        _NativeOnly.apply(x, weight, bias, running_mean, running_var).backward(dy)

    def step_own() -> None:
        own(x).backward(dy)

    def step_rounds() -> None:
        group.all_reduce_sum(fwd, TAGS[0])
        group.all_reduce_sum(bwd, TAGS[1])

    def step_fused() -> None:
        FusedBound.apply(x, weight, bias, 1e-5, group, sums).backward(dy)

    def step_syncbn() -> None:
        sbn(x).backward(dy)

    return {
        "bn": step_bn,
        "py-floor": step_floor,
        "own": step_own,
        "2rounds": step_rounds,
        "fused": step_fused,
        "syncbn": step_syncbn,
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    group = groups.ProcessGroupSum(None)
    results: dict[str, Any] = {}
    for spec in args.shapes.split(","):
        shape = tuple(int(d) for d in spec.split("x"))
        steps = _steps(shape, group)
        blocks: dict[str, list[float]] = {name: [] for name in steps}
        for block in range(args.blocks + 1):
            for name, step in steps.items():
                dist.barrier()
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                mine = statistics.median(times) * 1e3
                gathered: list[Any] = [None] * world_size
                dist.all_gather_object(gathered, mine)
                if block > 0:  # the first block warms up
                    blocks[name].append(max(gathered))
        ms = {name: statistics.median(values) for name, values in blocks.items()}
        results[spec] = {
            "median_ms": ms,
            "floor_over_bn": (ms["py-floor"] + ms["2rounds"]) / ms["bn"],
            "own_over_bn": ms["own"] / ms["bn"],
            "fused_over_bn": ms["fused"] / ms["bn"],
            "syncbn_over_bn": ms["syncbn"] / ms["bn"],
            "lockstep_ms": ms["syncbn"] - ms["own"] - ms["2rounds"],
        }
    if rank != 0:
        return
    print(
        f"W={world_size} gloo ranks, 1 thread each, {args.steps} steps per block, {args.blocks} blocks "
        f"interleaved; slowest rank's median per block, median of blocks, ms; load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'shape':>14} {'bn':>7} {'py-floor':>9} {'own':>7} {'2rounds':>8} {'fused':>7} {'syncbn':>7}"
        f" {'lockstep':>9} {'floor/bn':>9} {'own/bn':>7} {'fused/bn':>9} {'syncbn/bn':>10}"
    )
    for spec, rec in results.items():
        ms = rec["median_ms"]
        print(
            f"{spec:>14} {ms['bn']:7.3f} {ms['py-floor']:9.3f} {ms['own']:7.3f} {ms['2rounds']:8.3f}"
            f" {ms['fused']:7.3f} {ms['syncbn']:7.3f} {rec['lockstep_ms']:9.3f} {rec['floor_over_bn']:9.2f}"
            f" {rec['own_over_bn']:7.2f} {rec['fused_over_bn']:9.2f} {rec['syncbn_over_bn']:10.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "load": os.getloadavg(), "results": results}, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="64x128,8x32x8x8,256x512,32x256x8x8")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per block")
    parser.add_argument("--blocks", type=int, default=5, help="blocks per method (after one warm-up block)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
