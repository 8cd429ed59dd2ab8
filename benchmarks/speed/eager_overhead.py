"""Per-layer eager cost of syncbn's autograd path, without a transport, for before/after comparisons.

A group that claims two members and returns its input unchanged stands in for
the collective, so the time is syncbn's own work per layer (Python, dispatcher
calls, passes over memory): what a code change to the eager path can make
slower. Run it against two source trees, alternating, in fresh processes, the order
turning every round::

    python benchmarks/speed/eager_overhead.py --src OLD/src --src NEW/src --rounds 3

The children run with an allocator that keeps freed blocks (``skew.CONFIGS["no-trim"]``:
glibc's trim and mmap thresholds raised), because with glibc's defaults the page faults of
memory handed back to the kernel and faulted in again move a large shape's time by up to 40%
from one process to the next, whichever tree it runs; ``--allocator glibc`` measures with the
defaults instead (a change that allocates more shows there too).

Prints the median forward+backward thread CPU time per shape and source tree (ms, one
thread) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from skew import CONFIGS

SHAPES = ("32x64", "256x512", "64x256x4x4", "16x64x32x32")

_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
import syncbn

from syncbn.cli._bench_methods import LoopbackGroup as Loopback  # a group of 2 whose sum is the identity

out = {}
for spec in sys.argv[1].split(","):
    shape = [int(s) for s in spec.split("x")]
    bn = syncbn.SyncBatchNorm(shape[1], process_group=Loopback())
    x = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)
    iters = int(sys.argv[2]) or max(20, min(2000, int(2e7 // x.numel())))
    for _ in range(10):
        bn(x).backward(g)
    times = []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(iters):
            bn(x).backward(g)
        times.append((time.thread_time() - t) / iters * 1e3)
    out[spec] = min(times)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", action="append", required=True, help="a src/ folder holding syncbn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--iters", type=int, default=0, help="timed calls per repeat (default 0: by size)")
    parser.add_argument("--allocator", choices=sorted(CONFIGS), default="no-trim")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {src: [] for src in args.src}
    for i in range(args.rounds):
        # The order turns every round (ABBA...): a run measured faster in the second place of a
        # round whichever tree it was (up to 25% on the large shapes), so a fixed order is biased.
        for src in args.src if i % 2 == 0 else args.src[::-1]:
            env_path = {"PYTHONPATH": src, **CONFIGS[args.allocator]}
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, args.shapes, str(args.iters)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, **env_path},
            )
            runs[src].append(json.loads(proc.stdout))
    shapes = args.shapes.split(",")
    print(f"{'shape':>14} " + " ".join(f"{'src' + str(i):>10}" for i in range(len(args.src))) + "   ratio")
    for spec in shapes:
        medians = [statistics.median(r[spec] for r in runs[src]) for src in args.src]
        ratio = medians[-1] / medians[0]
        print(f"{spec:>14} " + " ".join(f"{m:10.4f}" for m in medians) + f"   {ratio:.3f}")
    for i, src in enumerate(args.src):
        print(f"src{i} = {src}")


if __name__ == "__main__":
    main()
