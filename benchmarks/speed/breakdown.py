"""Where the narrow net's synchronised step goes, per collective (issue 29, item 1).

Runs :mod:`syncbn.cli._bench_breakdown` (the same code as ``python -m syncbn
bench --breakdown``, longer and with every variant) on 2 gloo ranks: the narrow
net (24 conv3x3(32)-BN-ReLU blocks, 16 images of 8x8 per rank, 48 collectives
per step) with ``nn.BatchNorm2d`` and with ``syncbn.SyncBatchNorm2d``, changing
one thing at a time (no DDP, DDP bucket size, two torch threads, each rank
pinned to a core, the shared-memory wait's spin budget; opt-in: ``plain-compiled``,
``syncbn-compiled``, ``torch.compile(DDP(net))``), interleaved in rounds.
Per collective it shows the extra step time against nn.BatchNorm2d, split into
the time outside the collective (the layer's own eager work) and inside it:
waiting for the peer, the frame work, the exchange's arrival-to-release, and
the waiting rank's wake-up lag. ``--profile`` adds torch.profiler's top
operators (self CPU per step) of the net without DDP on rank 0, with syncbn over
a loopback group (its own ops, no collective waits) and with nn.BatchNorm2d::

    nice -n 10 python benchmarks/speed/breakdown.py [--rounds 3] [--steps 4] [--variants a,b] [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from syncbn import SyncBatchNorm2d
from syncbn.cli._bench_breakdown import DEFAULT, VARIANTS, breakdown, format_breakdown
from syncbn.cli._bench_e2e import deep_narrow
from syncbn.cli._bench_methods import LoopbackGroup
from syncbn.cli._launch import run_ranks


def _profile(rank: int, steps: int) -> dict[str, list[tuple[str, float, int]]]:
    """Top operators by self CPU (us per step) of the narrow net without DDP, per normalisation."""
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(10, (16,))
    out: dict[str, list[tuple[str, float, int]]] = {}
    loop = LoopbackGroup()

    def own(c: int) -> torch.nn.Module:
        return SyncBatchNorm2d(c, process_group=loop)

    # syncbn over the loopback group: its own ops, without the collectives' waits (which the
    # profiler would charge to SyncBatchNormFunction's self time).
    for name, norm in (("plain", torch.nn.BatchNorm2d), ("own", own)):
        net = deep_narrow(norm)
        for _ in range(2):
            F.cross_entropy(net(x), y).backward()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                F.cross_entropy(net(x), y).backward()
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:14]
        out[name] = [(e.key, e.self_cpu_time_total / steps, e.count // steps) for e in rows]
    return out


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    names = args.variants.split(",") if args.variants else DEFAULT
    res = breakdown(rank, world_size, names, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    prof = _profile(rank, args.profile_steps) if args.profile else None
    if rank != 0 or res is None:
        return
    print(
        f"narrow net, W={world_size} gloo ranks, 1 thread each unless named, {args.rounds} rounds x "
        f"{args.steps} steps interleaved (+{args.warmup} warm-up)"
    )
    print(format_breakdown(res))
    if prof is not None:
        for name, rows in prof.items():
            print(f"\ntorch.profiler, {name}, no DDP, rank 0: self CPU us per step (calls per step)")
            for key, us, count in rows:
                print(f"  {key:<44} {us:9.1f} ({count})")
        res["profile"] = prof
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "results": res}, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument(
        "--variants",
        default="",
        help=f"comma-separated, of: {','.join(VARIANTS)} (default: all but *-compiled)",
    )
    parser.add_argument("--profile", action="store_true", help="add torch.profiler's top operators")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args: Any = parser.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if bad:
        parser.error(f"unknown variant(s) {bad}: expected some of {list(VARIANTS)}")
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
