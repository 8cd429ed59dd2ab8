"""Per-call cost of syncbn's robustness layer (issue 5) on 2 local gloo ranks.

Times forward + backward of one ``SyncBatchNorm1d(512)`` layer on a
``(256, 512)`` float32 input per rank, in three settings, interleaved so that
machine noise hits them alike:

* ``default``: bounded waits (async ``all_reduce`` + ``work.wait(timeout)``),
  the once-per-layer handshake already done;
* ``debug``: ``SYNCBN_DEBUG=1``, one extra check collective (and a host read
  plus an ``isfinite`` pass) before each of the two collectives;
* ``unbounded``: ``SYNCBN_TIMEOUT=none``, the plain blocking ``all_reduce``
  (what the core did before issue 5).

Since issue 11 every collective is framed (a checked header, see
``syncbn.groups``); to measure what the frame costs, run this script
alternately against two checkouts (``PYTHONPATH=<old>/src`` and
``PYTHONPATH=<new>/src``), several rounds each, and compare the medians of
``default`` (see ``benchmarks/RESULTS.md``). ``--transport gloo`` keeps the
collectives on the process group (``SYNCBN_SHM=0``), ``shm`` (the default, as
in a job on one machine) uses shared memory.

Usage::

    python benchmarks/robustness/robustness_overhead.py [--steps 400] [--channels 512] [--batch 256]
        [--transport shm|gloo]

Prints medians in microseconds from rank 0. Not part of CI (timings are noisy).

``--frame-cost [--against OLD/src]`` measures instead, in one process on a
one-rank gloo group, what one call of the communication seam costs on each
transport (the frame's header, checks, padding and checksums included), for
the forward and backward vectors of layers of 64, 512 and 2048 channels;
with ``--against``, the same calls of an older checkout (loaded under another
package name) alternate with the current ones, call for call. With one rank
there is no waiting for a peer: what is left is the per-call work each rank
does, which is what the header adds. (The bytes a 4,112-value frame puts on
a real two-rank wire are measured by ``--wire``.)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import torch  # noqa: E402

import syncbn  # noqa: E402
from _helpers.dist_harness import launch  # noqa: E402

SETTINGS = ("unbounded", "default", "debug")


def _apply(setting: str) -> None:
    syncbn.set_debug(setting == "debug")
    syncbn.set_timeout(None if setting == "unbounded" else "default")


def _run(rank: int, world_size: int, steps: int, channels: int, batch: int, shared: bool) -> dict[str, float]:
    syncbn.set_shared_memory(shared)
    bn = syncbn.SyncBatchNorm1d(channels)
    x = torch.randn(batch, channels, requires_grad=True)
    g = torch.randn(batch, channels)
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for step in range(steps + 20):
        for setting in SETTINGS:
            _apply(setting)
            start = time.perf_counter()
            bn(x).backward(g)
            elapsed = time.perf_counter() - start
            if step >= 20:
                times[setting].append(elapsed)
    return {s: statistics.median(v) * 1e6 for s, v in times.items()}


def _load_old(src: str) -> Any:
    """The ``syncbn`` package of another checkout, imported as ``syncbn_old``."""
    path = os.path.join(src, "syncbn", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "syncbn_old", path, submodule_search_locations=[os.path.dirname(path)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["syncbn_old"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("syncbn_old.groups")


def _frame_cost(against: str | None, rounds: int) -> None:
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    from syncbn import groups

    torch.set_num_threads(1)
    old = _load_old(against) if against else None
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(tmp, "s"), 1),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
        for transport in ("shm", "gloo"):
            shared = transport == "shm"
            impls: dict[str, Callable[[torch.Tensor, int], Any]] = {}
            new = groups.ProcessGroupSum(None, shared_memory=shared)
            impls["new"] = lambda t, phase, g=new: g.all_reduce_sum(t, groups.Tag(12345, phase))
            if old is not None:
                before = old.ProcessGroupSum(None, shared_memory=shared)
                impls["old"] = lambda t, phase, g=before: g.all_reduce_sum(t)
            for channels in (64, 512, 2048):
                vectors = {
                    groups.PHASE_FORWARD: torch.zeros(2 * channels + 1, dtype=torch.float64),
                    groups.PHASE_BACKWARD: torch.zeros(2, channels, dtype=torch.float32),
                }
                times: dict[str, list[float]] = {name: [] for name in impls}
                for _ in range(rounds):
                    for name, call in impls.items():
                        start = time.perf_counter()
                        for phase, t in vectors.items():
                            call(t, phase)
                        times[name].append((time.perf_counter() - start) * 1e6)
                med = {name: statistics.median(v[rounds // 10 :]) for name, v in times.items()}
                line = f"  {transport:4s} C={channels:5d}  fwd+bwd collectives: new {med['new']:7.1f} us"
                if "old" in med:
                    added = med["new"] - med["old"]
                    line += f"   old {med['old']:7.1f} us   added {added:+6.1f} us per layer-step"
                print(line)
            new.close()
        dist.destroy_process_group()


def _wire(rank: int, world_size: int, rounds: int) -> dict[int, float]:
    import torch.distributed as dist

    sizes = (129, 1025, 4097, 4112)
    bufs = {n: torch.zeros(n, dtype=torch.float64) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            start = time.perf_counter()
            dist.all_reduce(bufs[n])
            times[n].append((time.perf_counter() - start) * 1e6)
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm")
    parser.add_argument("--frame-cost", action="store_true", help="per-call cost of the seam, one process")
    parser.add_argument("--against", metavar="SRC", help="with --frame-cost: an older checkout's src/")
    parser.add_argument("--wire", action="store_true", help="2-rank gloo all_reduce of 129..4096 float64")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    if args.frame_cost:
        print(f"per-call cost of the seam, 1 rank, medians of {args.rounds} interleaved rounds")
        _frame_cost(args.against, args.rounds)
        return
    if args.wire:
        wire = launch(_wire, 2, args.rounds, timeout=600)[0]
        print(f"2-rank gloo all_reduce, float64, medians of {args.rounds} interleaved rounds (rank 0)")
        for n, us in wire.items():
            print(f"  {n:5d} values  {us:7.1f} us")
        return
    shared = args.transport == "shm"
    results = launch(_run, 2, args.steps, args.channels, args.batch, shared, timeout=600)
    base = results[0]["unbounded"]
    print(
        f"(batch, channels) = ({args.batch}, {args.channels}), 2 gloo ranks, transport {args.transport}, "
        f"{args.steps} steps, medians"
    )
    for setting in SETTINGS:
        value = results[0][setting]
        print(f"  {setting:10s} {value:9.1f} us per forward+backward  ({value / base:.3f}x unbounded)")


if __name__ == "__main__":
    main()
