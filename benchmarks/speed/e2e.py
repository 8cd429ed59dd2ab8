"""End to end: one DDP training step on W gloo ranks, syncbn against plain ``nn.BatchNorm2d``.

Two models (:mod:`syncbn.cli._bench_e2e`): ``deep``, 24 conv3x3(32)-BN-ReLU blocks
on 16 images of 8x8 per rank (many small BN layers, the hard case for a
synchronised layer), and ``resnet``, a ResNet-style CIFAR model (15 BN layers,
32x32 images). Each runs three times under ``DistributedDataParallel``: with
``syncbn.SyncBatchNorm2d`` (CPU collectives through shared memory where every
rank is on one machine, the default), with ``syncbn.SyncBatchNorm2d`` on the
process group's own transport (``syncbn-pg``: gloo), and with plain
``nn.BatchNorm2d`` (unsynchronised: what DDP gives by default), and, with
``--fused-bound``, with :class:`syncbn.cli._bench_methods.FusedBoundBatchNorm2d` (``fused``: the
cost a compiled, fused-kernel syncbn could reach, the floor ``syncbn bench`` measures too). Steps
of all variants alternate in one loop; each rank's median step time is taken and the
slowest rank reported, with the ratios to plain (targets: deep <= 1.10,
resnet <= 1.03).

    python benchmarks/speed/e2e.py [--model deep,resnet] [--world-size 2] [--batch 16] [--steps 20]
                             [--fused-bound] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from syncbn import SyncBatchNorm2d
from syncbn.cli._bench_e2e import MODELS, format_e2e, slowest, time_steps
from syncbn.cli._bench_methods import FusedBoundBatchNorm2d
from syncbn.cli._launch import run_ranks
from syncbn.cli.bench import machine_info
from syncbn.groups import ProcessGroupSum


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    on_gloo = ProcessGroupSum(None, shared_memory=False)
    norms: dict[str, Any] = {
        "syncbn": SyncBatchNorm2d,
        "syncbn-pg": lambda c: SyncBatchNorm2d(c, process_group=on_gloo),
        "plain": nn.BatchNorm2d,
    }
    if args.fused_bound:
        shared = ProcessGroupSum(None)
        norms["fused"] = lambda c: FusedBoundBatchNorm2d(c, shared)
    results: dict[str, Any] = {}
    for model in args.model.split(","):
        mine = time_steps(model, rank, args.batch, args.steps, args.warmup, norms)
        ms, gathered = slowest(mine)
        results[model] = {
            "median_ms": ms,
            "per_rank_median_ms": gathered,
            "syncbn_over_plain": ms["syncbn"] / ms["plain"],
            "syncbn_pg_over_plain": ms["syncbn-pg"] / ms["plain"],
        }
        if "fused" in ms:
            results[model]["fused_over_plain"] = ms["fused"] / ms["plain"]
    if rank != 0:
        return
    print(
        f"e2e DDP training step, W={world_size} gloo, batch {args.batch}/rank, {args.threads} thread(s)/rank,"
        f" {args.steps} steps (+{args.warmup}), interleaved; slowest rank's median;"
        f" load {os.getloadavg()[0]:.2f}"
    )
    for model, rec in results.items():
        print(format_e2e(model, rec["median_ms"]))
    if args.json:
        payload = {"config": vars(args), "machine": machine_info(), "results": results}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2, default=str)
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="deep,resnet", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="images per rank (default 16)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--fused-bound", action="store_true", help="also time the fused floor (syncbn.cli._bench_methods)"
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
