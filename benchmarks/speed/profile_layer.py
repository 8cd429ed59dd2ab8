"""Where one small layer's time goes: local compute, syncbn's own Python/ATen work, the framing, waits.

One process, no peer to wait for, so the numbers hold on a busy machine. A
single-member gloo group (``FileStore``) gives a real :class:`~syncbn.groups.ProcessGroupSum`
whose CPU collectives go through a real one-slot shared-memory segment: every
per-call cost of the seam (header, checksum, copies, the flag wait, the sum) is
paid, only the waiting for other ranks is not. Per shape, interleaved, the
median thread CPU time (ms) of:

* ``bn``: ``nn.BatchNorm`` forward + backward (what unsynchronised training pays);
* ``loopback``: syncbn's autograd path with a group whose sum is the identity
  (the layer's own Python and ATen calls, no seam);
* ``seam``: syncbn's autograd path over the one-member ``ProcessGroupSum`` (the
  full per-layer cost without peers);
* ``2sums``: the two ``ProcessGroupSum.all_reduce_sum`` calls alone (``2C + 1``
  and ``2C`` values), tagged as the layer tags them;
* ``2shm``: the two ``SharedMemorySum.all_reduce_sum`` rounds alone (header
  fields precomputed): the shared-memory exchange itself;
* ``floor``: the fused floor (:mod:`syncbn.cli._bench_methods`: one native kernel either side
  of each collective) over the same one-member group: ``seam / floor`` is syncbn's per-layer
  cost against what a fused-kernel layer could reach, without peers or their lockstep.

``--profile`` adds a cProfile of ``seam`` (top functions by own time) and the
ATen operator counts of ``bn``, ``loopback`` and ``seam`` (``torch.profiler``).
For instruction counts, run one shape under ``valgrind --tool=callgrind`` with
``--callgrind-only METHOD`` (counts that do not depend on the machine's load)::

    python benchmarks/speed/profile_layer.py [--shapes 64x128,8x32x8x8] [--iters 400] [--profile]
    valgrind --tool=callgrind --callgrind-out-file=cg.out python benchmarks/speed/profile_layer.py \\
        --shapes 64x128 --callgrind-only seam --iters 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import syncbn
from syncbn import groups
from syncbn.cli._bench_methods import FusedBound, collective_buffers
from syncbn.engine._function import Params, SyncBatchNormFunction


class Loopback:
    """Two members that sum to the identity: syncbn's own work, no transport."""

    size, rank = 2, 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


def _layer_step(
    shape: tuple[int, ...], group: Any, dtype: torch.dtype, layer: Any = None
) -> Callable[[], None]:
    channels = shape[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(True)
    dy = torch.randn(shape, generator=gen, dtype=dtype)
    weight = torch.ones(channels, requires_grad=True)
    bias = torch.zeros(channels, requires_grad=True)
    rm, rv = torch.zeros(channels), torch.ones(channels)
    if group is None:
        bn = nn.BatchNorm1d(channels) if len(shape) <= 3 else nn.BatchNorm2d(channels)
        if len(shape) == 5:
            bn = nn.BatchNorm3d(channels)
        bn = bn.to(dtype) if dtype == torch.float64 else bn

        def step_bn() -> None:
            x.grad = None
            bn.zero_grad(set_to_none=True)
            bn(x).backward(dy)

        return step_bn
    if layer is None:
        layer = syncbn.SyncBatchNorm(channels)

    def step() -> None:
        x.grad = weight.grad = bias.grad = None
        out = SyncBatchNormFunction.apply(x, weight, bias, Params(rm, rv, 1e-5, 0.1, group, layer))
        out.backward(dy)

    return step


def _two_sums(channels: int, group: groups.ProcessGroupSum, layer: Any) -> Callable[[], None]:
    from syncbn import _checks

    fwd = torch.zeros(2 * channels + 1, dtype=torch.float64)
    bwd = torch.zeros(2 * channels, dtype=torch.float32)
    ident = _checks.layer_identity(layer, group)
    tf, tb = groups.Tag(ident, groups.PHASE_FORWARD), groups.Tag(ident, groups.PHASE_BACKWARD)

    def step() -> None:
        group.all_reduce_sum(fwd, tf, deferred=False)
        group.all_reduce_sum(bwd, tb, deferred=False)

    return step


def _two_shm(channels: int, group: groups.ProcessGroupSum) -> Callable[[], None]:
    shared = group._shared  # noqa: SLF001 - the exchange alone, for the breakdown
    assert shared is not None, "the shared-memory path is not available here"
    fwd = torch.zeros(2 * channels + 1, dtype=torch.float64)
    bwd = torch.zeros(2 * channels, dtype=torch.float32)
    ff = groups.header_fields(groups.Tag(7, groups.PHASE_FORWARD), 1, 1, fwd.numel(), 0)
    fb = groups.header_fields(groups.Tag(7, groups.PHASE_BACKWARD), 2, 1, bwd.numel(), 0)

    def step() -> None:
        shared.all_reduce_sum(fwd, 60.0, ff)
        shared.all_reduce_sum(bwd, 60.0, fb)

    return step


def _steps(shape: tuple[int, ...], group: groups.ProcessGroupSum, dtype: torch.dtype) -> dict[str, Any]:
    layer = syncbn.SyncBatchNorm(shape[1])
    steps = {
        "bn": _layer_step(shape, None, dtype),
        "loopback": _layer_step(shape, Loopback(), dtype),
        "seam": _layer_step(shape, group, dtype, layer),
        "2sums": _two_sums(shape[1], group, layer),
    }
    if group.uses_shared_memory:
        steps["2shm"] = _two_shm(shape[1], group)
    steps["floor"] = _floor_step(shape, group, dtype)
    return steps


def _floor_step(
    shape: tuple[int, ...], group: groups.ProcessGroupSum, dtype: torch.dtype
) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(True)
    dy = torch.randn(shape, generator=gen, dtype=dtype)
    weight = torch.ones(shape[1], dtype=dtype, requires_grad=True)
    bias = torch.zeros(shape[1], dtype=dtype, requires_grad=True)
    sums = collective_buffers(shape[1])

    def step() -> None:
        x.grad = weight.grad = bias.grad = None
        FusedBound.apply(x, weight, bias, 1e-5, group, sums).backward(dy)

    return step


def _time(steps: dict[str, Callable[[], None]], iters: int, warmup: int) -> dict[str, float]:
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for it in range(warmup + iters):
        for name, step in steps.items():
            start = time.thread_time()
            step()
            if it >= warmup:
                cpu[name].append(time.thread_time() - start)
    return {k: statistics.median(v) * 1e3 for k, v in cpu.items()}


def _op_counts(step: Callable[[], None], iters: int = 5) -> tuple[int, list[tuple[str, int]]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
    counts: Counter[str] = Counter()
    for event in prof.events():
        if (
            event.name.startswith("aten::")
            and event.cpu_parent is None
            or (
                event.name.startswith("aten::")
                and event.cpu_parent is not None
                and not event.cpu_parent.name.startswith("aten::")
            )
        ):
            counts[event.name] += 1
    total = sum(counts.values()) // iters
    return total, [(k, v // iters) for k, v in counts.most_common(12)]


def _cprofile(step: Callable[[], None], iters: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="64x128,8x32x8x8,256x512")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--callgrind-only", metavar="METHOD", help="run only this method, untimed")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    store_dir = tempfile.mkdtemp(prefix="syncbn-profile-")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = groups.ProcessGroupSum(None)
    group.all_reduce_sum(torch.zeros(1, dtype=torch.float64))  # connects the shared-memory path
    results: dict[str, Any] = {"load_average": os.getloadavg(), "shared_memory": group.uses_shared_memory}
    try:
        for spec in args.shapes.split(","):
            shape = tuple(int(d) for d in spec.split("x"))
            steps = _steps(shape, group, dtype)
            if args.callgrind_only:
                step = steps[args.callgrind_only]
                for _ in range(args.iters):
                    step()
                continue
            ms = _time(steps, args.iters, args.warmup)
            results[spec] = {"thread_cpu_median_ms": ms}
            print(f"{spec} {args.dtype}: median thread CPU ms over {args.iters} interleaved iterations")
            for name, value in ms.items():
                print(f"  {name:>9} {value:8.4f}   x bn {value / ms['bn']:6.2f}")
            print(f"  seam / floor {ms['seam'] / ms['floor']:.2f} (syncbn's layer against the fused floor's)")
            print(
                f"  breakdown: local bn {ms['bn']:.4f}; syncbn's own work (loopback - bn) "
                f"{ms['loopback'] - ms['bn']:.4f}; the seam's two framed sums (seam - loopback) "
                f"{ms['seam'] - ms['loopback']:.4f}"
                + (f" of which the shared-memory exchange {ms['2shm']:.4f}" if "2shm" in ms else "")
            )
            if args.profile:
                for name in ("bn", "loopback", "seam", "floor"):
                    total, top = _op_counts(steps[name])
                    results[spec].setdefault("aten_calls", {})[name] = total
                    print(f"  ATen calls per step, {name}: {total}: " + ", ".join(f"{k}x{v}" for k, v in top))
                print(_cprofile(steps["seam"], args.iters))
    finally:
        group.close()
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
