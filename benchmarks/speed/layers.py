"""Per layer, every method: ``syncbn bench``'s layer table plus the developers' methods.

``python -m syncbn bench`` times what a user compares (local BatchNorm, the two bare all_reduces,
syncbn, syncbn alone, the naive algorithm, torch's SyncBatchNorm). This script runs the same loop
(``syncbn.cli._bench_runner.bench_layers``, interleaved, the slowest rank's median) with three more
methods that take syncbn apart:

* ``2xAR-shm``: the two sums (``2C + 1`` and ``2C`` float64 values) through syncbn's own collective
  path (shared memory on CPU, one machine);
* ``local+AR``: ``nn.BatchNorm`` with the two process-group all-reduces where syncbn makes them
  (after its forward, inside its backward): the floor as a real step meets it, each collective
  also waiting for the slower rank;
* ``syncbn-pg``: ``syncbn.SyncBatchNorm`` with shared memory off, on the same transport as ``2xAR``
  (CPU only).

and their ratios: ``s/floor-shm`` = syncbn / (local + 2xAR-shm) (the floor on syncbn's own
transport), ``pg/l+AR`` = syncbn-pg / local+AR (the algorithm against the floor on the same
transport, collectives in place). The JSON has ``syncbn bench``'s layout (``benchmarks/report.py``
reads it). ``--force-sync`` runs ``syncbn`` and ``torch`` as their synchronised autograd functions
even on a group of one (``--world-size 1``: ``benchmarks/gpu_check.sh`` compares the two on one GPU)::

    python benchmarks/speed/layers.py [--world-size 2] [--shapes 16x64x32x32,256x512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from syncbn import SyncBatchNorm
from syncbn.cli._bench_methods import build, collective_buffers
from syncbn.cli._bench_report import LAYER_COLUMNS, format_table, ratio
from syncbn.cli._bench_runner import Step, bench_layers, machine_info, training_step, two_sums
from syncbn.cli._launch import default_backend, rank_device, run_ranks
from syncbn.cli.bench import DEFAULT_SHAPES, parse_shapes
from syncbn.engine._function import Params, SyncBatchNormFunction
from syncbn.groups import ProcessGroupSum

#: The layer table's columns with the developers' methods and ratios.
COLUMNS = [
    *LAYER_COLUMNS[:4],
    ("2xAR-shm", "ms", "2xAR-shm"),
    ("local+AR", "ms", "local+AR"),
    *LAYER_COLUMNS[4:6],
    ("sync-pg", "ms", "syncbn-pg"),
    *LAYER_COLUMNS[6:9],
    ("s/floor-shm", "r", "syncbn_over_own_floor"),
    ("pg/l+AR", "r", "syncbn_pg_over_interleaved_floor"),
    *LAYER_COLUMNS[9:],
]


class _CollectivesAround(torch.autograd.Function):
    """Identity that all-reduces ``fwd`` in forward and ``bwd`` in backward."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, fwd: Tensor, bwd: Tensor) -> Tensor:  # type: ignore[override]
        dist.all_reduce(fwd)
        ctx.bwd = bwd
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        dist.all_reduce(ctx.bwd)
        return grad, None, None


class LocalWithCollectives(nn.Module):
    """Local ``nn.BatchNorm`` plus syncbn's two all-reduces at the same points (the real floor)."""

    def __init__(self, bn: nn.Module, channels: int, device: torch.device) -> None:
        super().__init__()
        self.bn = bn
        self.fwd, self.bwd = collective_buffers(channels, device, torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _CollectivesAround.apply(self.bn(x), self.fwd, self.bwd)
        return out


class _ForcedSync(nn.Module):
    """``kind``'s synchronised autograd function (``"syncbn"`` or ``"torch"``), even on a group of one."""

    def __init__(self, bn: nn.Module, kind: str) -> None:
        super().__init__()
        self.bn = bn
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        bn: Any = self.bn
        if self.kind != "torch":
            params = Params(bn.running_mean, bn.running_var, bn.eps, bn.momentum, ProcessGroupSum())
            return SyncBatchNormFunction.apply(x, bn.weight, bn.bias, params)  # type: ignore[no-any-return]
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFn

        return TorchSyncFn.apply(  # type: ignore[no-untyped-call, no-any-return]
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, dist.group.WORLD, 1
        )


def developer_steps(x: Tensor, dy: Tensor, force_sync: bool = False) -> dict[str, Step]:
    """The three methods of the module docstring on input ``x`` (``syncbn-pg`` and ``2xAR-shm``: CPU).

    With ``force_sync``: ``syncbn`` and ``torch`` forced (replacing ``syncbn bench``'s), no shared memory.
    """
    channels = x.shape[1]
    local = LocalWithCollectives(build("local", x), channels, x.device)
    steps = {"local+AR": training_step(local, x, dy)}
    if force_sync:
        for kind in ("syncbn", "torch") if x.is_cuda else ("syncbn",):
            bn = build("local", x)  # its parameters and buffers, on x's device
            steps[kind] = training_step(_ForcedSync(bn, kind), x, dy)
    elif x.device.type == "cpu":
        steps["2xAR-shm"] = two_sums(channels, x.device, ProcessGroupSum(None).all_reduce_sum)
        no_shm = ProcessGroupSum(None, shared_memory=False)
        steps["syncbn-pg"] = training_step(SyncBatchNorm(channels, process_group=no_shm).train(), x, dy)
    return steps


def _add_ratios(ms: dict[str, float], out: dict[str, Any]) -> None:
    own_floor = ms["local"] + ms["2xAR-shm"] if "2xAR-shm" in ms else None
    out["own_floor_ms"] = own_floor
    out["syncbn_over_own_floor"] = ms["syncbn"] / own_floor if own_floor else None
    out["syncbn_over_interleaved_floor"] = ratio(ms, "syncbn", "local+AR")
    out["syncbn_pg_over_interleaved_floor"] = ratio(ms, "syncbn-pg", "local+AR")


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    records = bench_layers(
        rank,
        args.shapes,
        iters=args.iters,
        warmup=args.warmup,
        dtype=getattr(torch, args.dtype),
        device=rank_device(args.device),
        extra=lambda x, dy: developer_steps(x, dy, args.force_sync),
    )
    for rec in records:
        _add_ratios(rec["median_ms"], rec["ratios"])
        _add_ratios(rec["cpu_median_ms"], rec["cpu_ratios"])
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", type=parse_shapes, default=DEFAULT_SHAPES, help="e.g. 16x64x32x32,256x512"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default=None, help="default: gloo on cpu, nccl on cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--force-sync", action="store_true", help="syncbn and torch forced (see above)")
    parser.add_argument("--iters", type=int, default=40, help="timed iterations per method (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    args = parser.parse_args(argv)
    args.backend = args.backend or default_backend(args.device)
    records = run_ranks(_rank, args.world_size, args.backend, args)
    forced = ", syncbn and torch forced" if args.force_sync else ""
    print(
        f"per layer, W={args.world_size} {args.backend} {args.device} {args.dtype}{forced}, {args.iters} "
        f"iterations (+{args.warmup} warm-up); slowest rank's median forward+backward, ms"
    )
    print(format_table(records, columns=COLUMNS))
    print("\nthread CPU time of the same calls")
    print(format_table(records, "cpu_median_ms", COLUMNS))
    if args.json:
        config = {key: getattr(args, key) for key in ("world_size", "iters", "warmup", "dtype", "device")}
        config |= {"backend": args.backend, "threads_per_rank": args.threads, "force_sync": args.force_sync}
        with open(args.json, "w") as fh:
            json.dump({"config": config, "machine": machine_info(), "results": records}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
