"""Soak test (not in CI): many training steps on 2 gloo ranks, memory must stay flat.

Trains a 10-layer conv net (10 ``SyncBatchNorm2d`` layers) with DDP and SGD on 2
local CPU ranks for ``--steps`` steps, with syncbn's bounded waits on (default
settings) or debug mode (``--debug``). Each rank samples its resident set size
(``/proc/self/statm``) every ``--every`` steps; the script reports the growth
between the first sample after warm-up and the last, per rank, and fails when
it exceeds ``--max-growth-mib``.

Usage::

    python benchmarks/robustness/soak.py [--steps 1000] [--debug] [--max-growth-mib 8]

Result recorded in ``docs/robustness.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import syncbn  # noqa: E402
from _helpers.dist_harness import launch  # noqa: E402

LAYERS = 10
CHANNELS = 16


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model() -> nn.Module:
    blocks: list[nn.Module] = [nn.Conv2d(3, CHANNELS, 3, padding=1)]
    for i in range(LAYERS):
        blocks += [syncbn.SyncBatchNorm2d(CHANNELS), nn.ReLU()]
        if i < LAYERS - 1:
            blocks.append(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1))
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 10)]
    return nn.Sequential(*blocks)


def _soak(rank: int, world_size: int, steps: int, every: int, debug: bool) -> dict[str, Any]:
    syncbn.set_debug(debug)
    torch.manual_seed(0)
    net = _model()
    syncbn.name_layers(net)
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    samples: list[tuple[int, float]] = []
    start = time.monotonic()
    for step in range(1, steps + 1):
        x = torch.randn(8, 3, 12, 12, generator=gen)
        target = torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), target)
        loss.backward()
        opt.step()
        if step % every == 0:
            gc.collect()
            samples.append((step, _rss_mib()))
    elapsed = time.monotonic() - start
    return {
        "samples": samples,
        "seconds": elapsed,
        "loss": loss.item(),
        "tracked": int(net[1].num_batches_tracked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--max-growth-mib", type=float, default=8.0)
    args = parser.parse_args()
    results = launch(_soak, 2, args.steps, args.every, args.debug, timeout=3600)
    ok = True
    for rank, r in enumerate(results):
        warm = r["samples"][min(1, len(r["samples"]) - 1)]
        last = r["samples"][-1]
        growth = last[1] - warm[1]
        ok &= growth <= args.max_growth_mib and r["tracked"] == args.steps
        print(
            f"rank {rank}: {args.steps} steps in {r['seconds']:.1f} s "
            f"({1e3 * r['seconds'] / args.steps:.1f} ms/step), RSS {warm[1]:.1f} MiB at step {warm[0]} "
            f"-> {last[1]:.1f} MiB at step {last[0]} (growth {growth:+.2f} MiB), "
            f"num_batches_tracked {r['tracked']}, final loss {r['loss']:.3f}"
        )
    print("PASS: memory flat" if ok else "FAIL: memory grew or steps were lost")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
