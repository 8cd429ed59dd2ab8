"""Large layers: where a synchronised layer's extra time goes, with glibc's allocator and without its trim.

Two gloo ranks, one thread each, run in one loop, interleaved and with no barrier (as layers of a
model meet: each collective waits for whatever the peer did since the last one), the training
forward + backward of three layers on each ``--shapes`` input:

* ``local``: unsynchronised ``nn.BatchNorm``;
* ``syncbn``: :class:`syncbn.SyncBatchNorm` (shared-memory framed sums between the ranks);
* ``alone``: syncbn's engine with a loopback group (the same arithmetic and autograd path, the
  sums returned as they are: no peer, no waiting).

Per call and rank it records wall time and minor page faults (``RUSAGE_THREAD``), and for each
of syncbn's collectives the entry and exit (``perf_counter_ns``: one clock for every process on
Linux). Per collective it reports the *arrival skew* (how much later one rank entered than the
other) and whether one rank waited longer than ``--late-ms``.

Each configuration runs in fresh processes, the configurations alternating ``--rounds`` times:

* ``glibc``: the allocator as a user gets it;
* ``no-trim``: ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` set high, so freed
  activation-sized blocks stay in the heap instead of going back to the kernel (and coming back
  as page faults, a fault per 4 KiB page, when next written).

Printed: per configuration and shape, medians over rounds of the slowest rank's medians (ms), the
ratios ``syncbn / local`` and ``alone / local``, faults per call, the collective's median and mean
time (us), the median arrival skew (us) and the share of collectives where one rank waited
longer than ``--late-ms`` (the slow share), with the load average::

    python benchmarks/speed/skew.py [--shapes 4x32x8x16x16,16x64x32x32] [--iters 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

CONFIGS = {
    "glibc": {},
    "no-trim": {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "268435456"},
}
WARMUP = 10
METHODS = ("local", "syncbn", "alone")  # as syncbn bench builds them (syncbn.cli._bench_methods)


def _rank(rank: int, world: int, shapes: list[tuple[int, ...]], iters: int) -> list[dict[str, Any]]:
    from syncbn.cli._bench_methods import build
    from syncbn.cli._bench_runner import time_interleaved, training_step
    from syncbn.groups import ProcessGroupSum

    log: list[tuple[int, int]] = []
    plain_sum = ProcessGroupSum.all_reduce_sum

    def logged(self: Any, *args: Any, **kwargs: Any) -> Tensor:
        start = time.perf_counter_ns()
        out: Tensor = plain_sum(self, *args, **kwargs)
        log.append((start, time.perf_counter_ns()))
        return out

    ProcessGroupSum.all_reduce_sum = logged  # type: ignore[method-assign]
    records = []
    for shape in shapes:
        gen = torch.Generator().manual_seed(rank)
        x_data, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        steps = {name: training_step(build(name, x_data), x_data, grad) for name in METHODS}
        faults: dict[str, list[int]] = {}
        log.clear()
        times = time_interleaved(steps, iters, WARMUP, barrier=False, cuda=False, faults=faults)
        logs: list[Any] = [None] * world
        dist.all_gather_object(logs, log[2 * WARMUP :])
        mine = {
            "ms": {name: statistics.median(ts) * 1e3 for name, ts in times.items()},
            "faults": {name: statistics.mean(counts) for name, counts in faults.items()},
        }
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        records.append({"shape": list(shape), "ranks": everyone, "logs": logs})
    return records


def _collectives(logs: list[list[tuple[int, int]]], late_ms: float) -> dict[str, float]:
    """Per collective of two ranks: time in the call, arrival skew, share where one rank waited."""
    calls = [(b - a) / 1e3 for log in logs for a, b in log]
    skews, slow = [], 0
    for (a0, b0), (a1, b1) in zip(*logs):
        skews.append(abs(a0 - a1) / 1e3)
        waited = (b0 - a0) if a0 < a1 else (b1 - a1)
        slow += waited > late_ms * 1e6
    return {
        "call_median_us": statistics.median(calls),
        "call_mean_us": statistics.mean(calls),
        "skew_median_us": statistics.median(skews),
        "slow_share": slow / max(1, len(skews)),
    }


def _child(args: argparse.Namespace) -> None:
    from syncbn.cli._launch import run_ranks

    shapes = [tuple(int(s) for s in text.split("x")) for text in args.shapes.split(",")]
    records = run_ranks(_rank, 2, "gloo", shapes, args.iters)
    out = []
    for rec in records:
        ranks = rec["ranks"]
        slowest = {name: max(r["ms"][name] for r in ranks) for name in ranks[0]["ms"]}
        faults = {name: max(r["faults"][name] for r in ranks) for name in ranks[0]["faults"]}
        waits = _collectives(rec["logs"], args.late_ms)
        out.append({"shape": rec["shape"], "ms": slowest, "faults": faults, **waits})
    print("RESULT " + json.dumps(out))


def _table(results: dict[str, list[list[dict[str, Any]]]]) -> str:
    from syncbn.cli._output import format_table

    head = ["config", "shape", "local", "syncbn", "alone", "s/local", "a/local", "flt local", "flt syncbn"]
    head += ["coll med", "coll mean", "skew med", "slow share"]
    rows = []
    for config, runs in results.items():
        for i, first in enumerate(runs[0]):

            def med(get: Any, i: int = i, runs: list[Any] = runs) -> float:
                return statistics.median(get(run[i]) for run in runs)

            ms = [f"{med(lambda r, k=k: r['ms'][k]):.3f}" for k in METHODS]
            ratios = [f"{med(lambda r, k=k: r['ms'][k] / r['ms']['local']):.2f}" for k in ("syncbn", "alone")]
            faults = [f"{med(lambda r, k=k: r['faults'][k]):.0f}" for k in ("local", "syncbn")]
            waits = [
                f"{med(lambda r, k=k: r[k]):.0f}"
                for k in ("call_median_us", "call_mean_us", "skew_median_us")
            ]
            share = f"{med(lambda r: r['slow_share']):.2f}"
            rows.append([config, "x".join(map(str, first["shape"])), *ms, *ratios, *faults, *waits, share])
    return format_table(head, rows, [False, False] + [True] * (len(head) - 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x32x8x16x16,16x64x32x32,32x256x8x8")
    parser.add_argument("--iters", type=int, default=60, help="timed iterations per method and run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration, alternating")
    parser.add_argument("--late-ms", type=float, default=0.5, help="a wait longer than this counts as slow")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    load_start = os.getloadavg()
    results: dict[str, list[Any]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, env in CONFIGS.items():
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--shapes",
                args.shapes,
                "--iters",
                str(args.iters),
                "--late-ms",
                str(args.late_ms),
            ]
            done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
            results[name].append(json.loads(line[len("RESULT ") :]))
    print(
        f"2 gloo ranks, 1 thread each, {args.iters} iterations x {args.rounds} rounds per configuration; "
        "ms: slowest rank's median; flt: minor page faults per call (worse rank); coll: syncbn's framed "
        f"sums (us); skew: arrival skew (us); slow share: one rank waited > {args.late_ms} ms"
    )
    print(_table(results))
    print(
        f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in load_start)} at start, "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at end"
    )


if __name__ == "__main__":
    main()
