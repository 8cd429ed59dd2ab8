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

    python benchmarks/robustness_overhead.py [--steps 400] [--channels 512] [--batch 256]
        [--transport shm|gloo]

Prints medians in microseconds from rank 0. Not part of CI (timings are noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402

import syncbn  # noqa: E402
from dist_harness import launch  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm")
    args = parser.parse_args()
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
