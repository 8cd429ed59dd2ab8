"""The hierarchical path on one machine, machines simulated: cost per layer-step against flat paths.

W ranks on this machine are told they sit on ``--machines`` machines (consecutive ranks share a
host key); per rank, interleaved, the two sums of one layer (``2C + 1`` float64 and ``2C``
float32 values) through:

* ``shm``: the flat shared-memory path (every rank on one machine: today's default here);
* ``gloo``: the process group's transport (shared memory off: today's path across machines);
* ``hier``: the hierarchical path (machine groups through shared memory, leaders over gloo).

On one machine the leaders' gloo hop is loopback TCP, so this measures the path's own cost
(three framed steps instead of one), not a network. Slowest rank's median, microseconds.

    python benchmarks/hierarchical.py [--world-size 4] [--machines 2] [--channels 128] [--iters 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from syncbn import _shm, groups
from syncbn.cli._bench_runner import time_interleaved
from syncbn.cli._launch import run_ranks


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    flat = groups.ProcessGroupSum(None)
    flat.all_reduce_sum(torch.zeros(1, dtype=torch.float64))  # connected before the keys change
    gloo = groups.ProcessGroupSum(None, shared_memory=False)
    per = world_size // args.machines
    key = 1000.0 + rank // per
    _shm._host_key = lambda: key  # type: ignore[assignment]
    hier = groups.ProcessGroupSum(None, hierarchical=True)
    hier.all_reduce_sum(torch.zeros(1, dtype=torch.float64))
    assert hier.hierarchical
    fwd = torch.zeros(2 * args.channels + 1, dtype=torch.float64)
    bwd = torch.zeros(2 * args.channels, dtype=torch.float32)
    tf, tb = groups.Tag(5, groups.PHASE_FORWARD), groups.Tag(5, groups.PHASE_BACKWARD)

    def two(group: groups.ProcessGroupSum) -> Any:
        def step() -> None:
            group.all_reduce_sum(fwd, tf)
            group.all_reduce_sum(bwd, tb)

        return step

    times = time_interleaved(
        {"shm": two(flat), "gloo": two(gloo), "hier": two(hier)}, args.iters, 10, barrier=True, cuda=False
    )
    mine = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        slowest = {k: max(g[k] for g in gathered) for k in mine}
        print(
            f"W={world_size} as {args.machines} simulated machines, C={args.channels},"
            f" {args.iters} iterations, load {os.getloadavg()[0]:.2f}:"
            " slowest rank's median us per layer-step (2 sums):"
        )
        print("  " + "   ".join(f"{k} {v:.0f}" for k, v in slowest.items()))
    for g in (flat, gloo, hier):
        g.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if args.world_size % args.machines or args.world_size // args.machines < 2:
        parser.error("--world-size must be a multiple of --machines, with at least 2 ranks per machine")
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
