"""DDP training step, compiled and eager, of syncbn against a compiled ``nn.BatchNorm2d`` twin, 2 gloo ranks.

    python benchmarks/compile/compile_step.py [--steps 10] [--rounds 5] [--threads 1] [--nets narrow,wide]
    python benchmarks/compile/compile_step.py --eager-forms

``--eager-forms`` times instead, in one process, one layer's eager forward +
backward through the eager autograd function and through the traced form the
compiler sees (``syncbn.engine._compiled``, run eagerly), with a loopback group: what
serving eager mode with the traced form would cost.

Two networks (Conv-BN-ReLU blocks, then pooling and a linear head:
:func:`syncbn.cli._bench_e2e.conv_net`, which ``python -m syncbn bench --compiled``
times too, there with the narrow net 32 channels wide, as in its eager step):

* ``narrow``: 24 blocks of 16 channels, 16 images of 8x8 per rank (small
  layers: per-layer overhead decides);
* ``wide``: 4 blocks of 16-64 channels, 16 images of 32x32 per rank.

Variants, each a fresh model per network: ``bn compiled`` (the same network with
``nn.BatchNorm2d``, ``torch.compile(DDP(model))``: the reference a compiled
syncbn model should match), ``syncbn eager`` (``DDP(model)``) and ``syncbn
compiled`` (``torch.compile(DDP(model))``). Every variant compiles and warms
up first (the first step's time is reported as its compile time); then the
variants take turns, ``--rounds`` rounds of ``--steps`` steps each (forward,
cross-entropy, backward, SGD), a barrier before each step. Printed: the
slowest rank's median step and the ratios. CPU, float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from syncbn.cli._bench_e2e import conv_net

VARIANTS = ("bn compiled", "syncbn eager", "syncbn compiled")
NETS = {  # name: (block widths, per-rank input (N, C, H, W))
    "narrow": ((16,) * 24, (16, 3, 8, 8)),
    "wide": ((16, 32, 32, 64), (16, 3, 32, 32)),
}


def _variant(name: str, widths: tuple[int, ...]) -> tuple[nn.Module, nn.Module]:
    import syncbn

    norm: Callable[[int], nn.Module] = nn.BatchNorm2d if name.startswith("bn") else syncbn.SyncBatchNorm2d
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(conv_net(norm, widths))
    return (torch.compile(ddp) if name.endswith("compiled") else ddp), ddp


def _worker(rank: int, world: int, tmp: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    result: dict[str, float] = {}
    for net in args.nets.split(","):
        widths, shape = NETS[net]
        x = torch.randn(*shape)
        y = torch.randint(0, 10, (shape[0],))
        steps: dict[str, Callable[[], None]] = {}
        for name in VARIANTS:
            model, ddp = _variant(name, widths)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

            def step(
                model: nn.Module = model, opt: torch.optim.Optimizer = opt, x: Any = x, y: Any = y
            ) -> None:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()

            dist.barrier()
            start = time.perf_counter()
            step()
            result[f"{net}/{name}/first step s"] = time.perf_counter() - start
            for _ in range(2):
                step()
            steps[name] = step
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name in VARIANTS:
                for _ in range(args.steps):
                    dist.barrier()
                    t = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - t)
        for name in VARIANTS:
            result[f"{net}/{name}"] = statistics.median(times[name]) * 1e3
    out[rank] = result
    dist.destroy_process_group()


def _eager_forms() -> None:
    import syncbn
    import syncbn.modules

    torch.set_num_threads(1)

    class Loopback:
        size, rank = 2, 0

        def all_reduce_sum(self, t: torch.Tensor, tag: Any = None, deferred: Any = None) -> torch.Tensor:
            return t

    print("one layer forward + backward, thread CPU ms (median of 50), loopback group, 1 thread")
    for shape in ((32, 64), (256, 512), (64, 256, 4, 4), (16, 64, 32, 32)):
        bn = syncbn.SyncBatchNorm(shape[1], process_group=Loopback())
        x = torch.randn(*shape, requires_grad=True)
        g = torch.randn(*shape)
        res = {}
        for form in ("eager function", "traced form"):
            times = []
            for _ in range(60):
                if form == "traced form":  # the layer takes its compile path, run eagerly
                    syncbn.modules._is_compiling = lambda: True
                t = time.thread_time()
                bn(x).backward(g)
                times.append(time.thread_time() - t)
                syncbn.modules._is_compiling = torch.compiler.is_compiling
            res[form] = statistics.median(times[10:]) * 1e3
        ratio = res["traced form"] / res["eager function"]
        text = ", ".join(f"{k} {v:.3f}" for k, v in res.items())
        print(f"  {'x'.join(map(str, shape)):>12}: {text} ({ratio:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nets", default="narrow,wide")
    parser.add_argument("--eager-forms", action="store_true")
    args = parser.parse_args()
    if args.eager_forms:
        _eager_forms()
        return
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(2, tmp, args, out), nprocs=2, start_method="fork")
        results = dict(out)
    print(
        f"W=2 gloo cpu float32, {args.threads} thread(s)/rank, {args.rounds} rounds x {args.steps} steps "
        f"interleaved, torch {torch.__version__}, load {open('/proc/loadavg').read().split()[:3]}"
    )
    for net in args.nets.split(","):
        widths, shape = NETS[net]
        print(f"\n{net}: {len(widths)} blocks {widths[0]}-{widths[-1]} channels, {shape} per rank")
        slow = {name: max(r[f"{net}/{name}"] for r in results.values()) for name in VARIANTS}
        for name in VARIANTS:
            first = max(r[f"{net}/{name}/first step s"] for r in results.values())
            print(
                f"  {name:>16}: {slow[name]:8.2f} ms/step (slowest rank's median), first step {first:6.1f} s"
            )
        print(f"  syncbn compiled / bn compiled: {slow['syncbn compiled'] / slow['bn compiled']:.2f}x")
        print(f"  syncbn compiled / syncbn eager: {slow['syncbn compiled'] / slow['syncbn eager']:.2f}x")


if __name__ == "__main__":
    main()
