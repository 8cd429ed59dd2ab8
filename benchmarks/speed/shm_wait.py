"""The shared-memory exchange alone: one framed sum back to back, after cache-evicting work, one rank late.

Two gloo ranks, one thread each, the default group's framed sum of ``--values`` float64 values
(``groups.resolve(None).all_reduce_sum``: the frame and the shared-memory exchange of
:mod:`syncbn._shm`). Three patterns, interleaved in ``--rounds`` rounds of ``--calls`` calls:

* ``b2b``: back to back, both ranks present (the floor of one call);
* ``cold``: before each call both ranks touch ``--evict-kb`` KiB of fresh memory and run a
  small convolution (as a layer of the narrow net does), so the exchange runs with cold
  caches, as it does inside a training step;
* ``layer``: before each call both ranks run the forward and backward of one conv-BN-ReLU block
  of the narrow net (32 channels, 16 images of 8x8: autograd, the dispatcher, the kernels), so
  the exchange also finds the interpreter's and torch's code paths cold;
* ``late``: rank 1 computes ``--late-ms`` ms (a busy loop) before each call, so rank 0 waits
  in the exchange: its *wake lag* (its exit after the late rank's exit) and its CPU time per
  wait show what the wait costs.

Each pattern runs with each wait of ``--waits`` (interleaved): ``kernel`` (the default where
futexes work: spin for the adaptive budget, then sleep in the kernel until the peer's wake),
``kernel-spin0`` (sleep in the kernel at once), ``steps`` (the fallback, and the wait before
issue 29: spin, then sleep in steps of 20 us to 1 ms), ``steps-spin0``.

``--step``: instead, the narrow net's step breakdown of ``benchmarks/speed/breakdown.py`` with
the waits as variants in the same interleaved rounds (``syncbn``: the kernel wait;
``syncbn-steps``: the stepped sleep after the same spin; ``syncbn-spin0``, ``syncbn-steps-spin0``:
no spin; ``syncbn-spin<N>us``: a fixed spin of N us before the kernel sleep), so one run compares
them under one load.

Per call and rank it logs the exchange's entry and exit (``perf_counter_ns``, one clock for
every process on Linux) and the call's CPU time; it prints medians (us): ``call`` (the framed
sum, the rank's view), ``release`` (the later rank's exchange from entry to exit: both ranks
present), ``lag`` (the earlier rank's exit after the later rank's exit), ``cpu`` (the earlier
rank's CPU time in the call), with the load average::

    nice -n 10 python benchmarks/speed/shm_wait.py [--calls 300] [--rounds 3] [--late-ms 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from syncbn import groups
from syncbn.cli._launch import run_ranks

PATTERNS = ("b2b", "cold", "layer", "late")
WAITS = ("kernel", "kernel-spin0", "steps", "steps-spin0")


def _calls(rank: int, args: argparse.Namespace, pattern: str, wait: str, group: Any, log: list[Any]) -> None:
    t = torch.zeros(args.values, dtype=torch.float64)
    shared = group._shared  # noqa: SLF001 - the benchmark times the exchange inside the call
    inner = shared.all_reduce_sum
    waiter = getattr(shared, "_waiter", None)  # absent before issue 29: steps only
    futex = getattr(waiter, "futex", None)
    if waiter is not None and wait.startswith("steps"):
        waiter.futex = None
    if wait.endswith("spin0"):
        shared.spin.budget = lambda now: 0.0
    marks: list[int] = []

    def timed(*a: Any, **k: Any) -> Any:
        marks.append(time.perf_counter_ns())
        out = inner(*a, **k)
        marks.append(time.perf_counter_ns())
        return out

    shared.all_reduce_sum = timed
    evict = torch.empty(args.evict_kb * 128, dtype=torch.float64)
    x = torch.randn(16, 32, 8, 8)
    w = torch.randn(32, 32, 3, 3)
    late_s = args.late_ms / 1e3 if rank == 1 else 0.0
    nn = torch.nn
    layer = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
    xg = x.clone().requires_grad_(True)
    dist.barrier()
    try:
        for _ in range(args.calls):
            if pattern == "cold":
                evict.fill_(1.0)
                F.conv2d(x, w, padding=1)
            elif pattern == "layer":
                layer(xg).sum().backward()
            elif pattern == "late" and late_s:
                end = time.perf_counter() + late_s
                while time.perf_counter() < end:
                    pass
            marks.clear()
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            group.all_reduce_sum(t)
            w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            log.append((w0, w1, c1 - c0, marks[0], marks[1]))
    finally:
        shared.all_reduce_sum = inner
        if waiter is not None:
            waiter.futex = futex
        shared.spin.__dict__.pop("budget", None)


def _steps_wait(shared: Any) -> Any:
    """Switch ``shared`` to the stepped sleep after the spin; returns the undo."""
    waiter = getattr(shared, "_waiter", None)
    if waiter is None:
        return lambda: None  # before issue 29: the stepped wait already
    futex = waiter.futex
    waiter.futex = None

    def undo() -> None:
        waiter.futex = futex

    return undo


def _step_breakdown(rank: int, world_size: int, args: argparse.Namespace) -> Any:
    import breakdown as bd  # this folder's breakdown.py

    bd.VARIANTS["syncbn-steps"] = {"wait": "steps"}
    bd.VARIANTS["syncbn-steps-spin0"] = {"wait": "steps", "spin_s": 0.0}
    for us in (100, 200, 500, 1000, 2000):
        bd.VARIANTS[f"syncbn-spin{us}us"] = {"spin_s": us * 1e-6}
    settings = bd._settings  # noqa: SLF001

    @contextmanager
    def with_wait(spec: dict[str, Any], r: int) -> Iterator[None]:
        with settings(spec, r):
            shared = getattr(groups.resolve(None), "_shared", None)
            undo = _steps_wait(shared) if spec.get("wait") == "steps" and shared is not None else None
            try:
                yield
            finally:
                if undo is not None:
                    undo()

    bd._settings = with_wait  # noqa: SLF001
    names = args.variants.split(",")
    res = bd.breakdown(rank, world_size, names, rounds=args.rounds, steps=args.step_count, warmup=2)
    return None if res is None else bd.format_breakdown(res)


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any] | None:
    group = groups.resolve(None)
    assert isinstance(group, groups.ProcessGroupSum)
    for _ in range(20):
        group.all_reduce_sum(torch.zeros(args.values, dtype=torch.float64))
    assert group._shared is not None, "the shared-memory path is not in use"  # noqa: SLF001
    runs = [(p, w) for p in args.patterns for w in args.waits]
    logs: dict[str, list[Any]] = {f"{p} {w}": [] for p, w in runs}
    for _ in range(args.rounds):
        for p, w in runs:
            _calls(rank, args, p, w, group, logs[f"{p} {w}"])
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, logs)
    if rank != 0:
        return None
    out: dict[str, Any] = {}
    for p in logs:
        call, release, lag, cpu = [], [], [], []
        for i in range(len(gathered[0][p])):
            rows = [g[p][i] for g in gathered]
            later = max(range(world_size), key=lambda r: rows[r][3])
            release.append(rows[later][4] - rows[later][3])
            for r, row in enumerate(rows):
                call.append(row[1] - row[0])
                if r != later:
                    lag.append(row[4] - rows[later][4])
                    cpu.append(row[2])
        out[p] = {
            k: statistics.median(v) / 1e3
            for k, v in (("call", call), ("release", release), ("lag", lag), ("cpu", cpu))
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per pattern and round (300)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--values", type=int, default=65, help="float64 values per sum (65)")
    parser.add_argument("--late-ms", type=float, default=1.0, help="rank 1's compute before each late call")
    parser.add_argument("--evict-kb", type=int, default=2048, help="memory touched before each cold call")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--waits", default=",".join(WAITS))
    parser.add_argument("--step", action="store_true", help="the narrow net's step breakdown instead")
    parser.add_argument("--variants", default="plain,syncbn,syncbn-steps,syncbn-spin0,syncbn-steps-spin0")
    parser.add_argument("--step-count", type=int, default=4, help="with --step: steps per variant and round")
    args = parser.parse_args(argv)
    args.patterns = args.patterns.split(",")
    args.waits = args.waits.split(",")
    before = os.getloadavg()[0]
    if args.step:
        print(f"load {before:.2f} at the start")
        print(run_ranks(_step_breakdown, 2, "gloo", args))
        return 0
    res = run_ranks(_rank, 2, "gloo", args)
    print(
        f"2 ranks, {args.values} float64, {args.rounds} rounds x {args.calls} calls, load "
        f"{before:.2f} -> {os.getloadavg()[0]:.2f}; medians, us"
    )
    print(f"  {'pattern, wait':<20} {'call':>8} {'release':>8} {'lag':>8} {'cpu':>8}")
    for p, row in res.items():
        print(f"  {p:<20} " + " ".join(f"{row[k]:8.1f}" for k in ("call", "release", "lag", "cpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
