"""``python -m syncbn bench``: syncbn's per-layer and end-to-end cost on W ranks (docs/internals/cli.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..groups import ProcessGroupSum
from ..modules import SyncBatchNorm2d
from . import _args
from ._bench_e2e import MODELS, format_e2e, slowest, time_steps
from ._bench_methods import FusedBoundBatchNorm2d, LoopbackGroup, NaiveSyncBatchNorm
from ._bench_report import allocator_note, format_table, format_targets, load_average, targets
from ._bench_runner import bench_layers, machine_info
from ._launch import DEFAULT_TIMEOUT_S, add_launch_arguments, default_backend, rank_device, run_ranks

__all__ = ["DEFAULT_SHAPES", "LoopbackGroup", "NaiveSyncBatchNorm", "add_arguments", "parse_shapes", "run"]

DEFAULT_SHAPES: list[tuple[int, ...]] = [
    (8, 32, 8, 8),
    (64, 128),
    (16, 64, 32, 32),
    (32, 256, 8, 8),
    (256, 512),
    (4, 32, 8, 16, 16),
    (32, 64, 56, 56),
]


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"16x64x32x32,256x512"`` -> ``[(16, 64, 32, 32), (256, 512)]``."""
    shapes = []
    for part in text.split(","):
        try:
            dims = tuple(int(d) for d in part.strip().lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) < 2 or any(d <= 0 for d in dims):
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: expected e.g. 16x64x32x32")
        shapes.append(dims)
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=DEFAULT_SHAPES,
        help="comma-separated per-rank input shapes, e.g. 16x64x32x32,256x512 (default: 7 shapes)",
    )
    e2e = "timed DDP steps of each --nets net: syncbn, nn.BatchNorm2d, the fused floor (default 10; 0: skip)"
    _args.add_counts(
        parser,
        {
            "--iters": (40, 1, "timed iterations per method, at least 1 (default 40)"),
            "--warmup": (5, 0, "untimed iterations first, 0 or more (default 5)"),
            "--threads": (1, 1, "torch threads per rank, at least 1 (default 1)"),
            "--e2e-steps": (10, 0, e2e),
        },
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    add_launch_arguments(parser, "where the layers run (default cpu)")
    parser.add_argument(
        "--nets",
        type=parse_nets,
        default=["deep"],
        help=f"comma-separated nets of the eager DDP step, of {','.join(MODELS)} (default: deep)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also time the narrow and the wide net's compiled DDP step (--e2e-steps, at least 3; W > 1)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=_args.output_file, help="write every number to this JSON file"
    )


def parse_nets(text: str) -> list[str]:
    """``"deep,wide"`` -> ``["deep", "wide"]``, each a net of :data:`~._bench_e2e.MODELS`."""
    nets = [part.strip() for part in text.split(",") if part.strip()]
    bad = [net for net in nets if net not in MODELS]
    if bad or not nets:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(MODELS)} (got {text!r})")
    return nets


#: The ratios a net's record has, where both variants ran: ``{a}_over_{b}`` is ``a``'s step over ``b``'s.
_NET_RATIOS = (("syncbn", "plain"), ("syncbn", "fused"), ("fused", "plain"), ("syncbn", "torch"))


def _net(mine: dict[str, float], **extra: Any) -> dict[str, Any]:
    """One net's record: the slowest rank's median step per variant (collective) and its ratios."""
    ms, _ = slowest(mine)
    ratios = {f"{a}_over_{b}": ms[a] / ms[b] for a, b in _NET_RATIOS if a in ms and b in ms}
    return {"median_ms": ms, **extra, **ratios}


def _steps(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> tuple[Any, Any]:
    """The nets' eager steps (the fused floor in the same loop); with ``--compiled``, the compiled ones."""
    e2e: dict[str, Any] | None = None
    compiled: dict[str, Any] | None = None
    floor_group = ProcessGroupSum(None)  # the floor's two sums: syncbn's transport, a group of its own
    eager_norms: dict[str, Any] = {"syncbn": SyncBatchNorm2d, "plain": nn.BatchNorm2d}
    eager_norms["fused"] = lambda c: FusedBoundBatchNorm2d(c, floor_group)
    if device.type == "cuda" and dist.get_backend() == "nccl":
        eager_norms["torch"] = nn.SyncBatchNorm
    if args.e2e_steps > 0:
        e2e = {
            net: _net(time_steps(net, rank, 16, args.e2e_steps, 2, eager_norms, device=device))
            for net in args.nets
        }
    if args.compiled:
        compiled = {}
        for model in ("deep", "wide"):
            first: dict[str, float] = {}
            steps = max(args.e2e_steps, 3)
            mine = time_steps(model, rank, 16, steps, 3, compiled=True, device=device, first_s=first)
            compiled[model] = _net(mine, first_step_s=slowest(first)[0])
    floor_group.close()
    return e2e, compiled


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    load_start = load_average()
    torch.set_num_threads(args.threads)
    device = rank_device(args.device)
    dtype = getattr(torch, args.dtype)
    records = bench_layers(
        rank, args.shapes, iters=args.iters, warmup=args.warmup, dtype=dtype, device=device
    )
    e2e, compiled = _steps(args, rank, world_size, device) if world_size > 1 else (None, None)
    if rank != 0:
        return
    config = {key: getattr(args, key) for key in ("iters", "warmup", "dtype", "device", "backend")}
    config |= {"world_size": world_size, "threads_per_rank": args.threads, "compiled": args.compiled}
    config["nets"] = args.nets
    config["statistic"] = "median over iterations per rank, then the slowest rank"
    print(
        f"syncbn bench: W={world_size} {args.backend} {args.device} {args.dtype}, "
        f"{args.threads} thread(s)/rank, {args.iters} iterations (+{args.warmup} warm-up); "
        "slowest rank's median forward+backward, ms"
    )
    print(format_table(records))
    print(
        "\nthread CPU time of the same calls (compute cost without waiting: steadier on a busy machine;"
        " '2xAR' here is only the CPU side of the collectives)"
    )
    print(format_table(records, "cpu_median_ms"))
    if e2e is not None:
        print(
            f"\nend to end, DDP training step, {args.e2e_steps} steps interleaved, slowest rank's median"
            " ('fused': the fused floor, what a fused-kernel syncbn could reach here):"
        )
        for net, rec in e2e.items():
            print(format_e2e(net, rec["median_ms"]) + f"   syncbn / fused {rec['syncbn_over_fused']:.3f}")
    if compiled is not None:
        print("\ncompiled, torch.compile(DDP(net)) training step, interleaved, slowest rank's median:")
        for model, rec in compiled.items():
            first = ", ".join(f"{k} {v:.0f} s" for k, v in rec["first_step_s"].items())
            print(format_e2e(model, rec["median_ms"]) + f"   (first step: {first})")
    compiled_ms = {k: v["median_ms"] for k, v in (compiled or {}).items()}
    rows = targets(records, {k: v["median_ms"] for k, v in (e2e or {}).items()}, compiled_ms)
    load_end = load_average()
    print("\ntargets (ratio <= goal; steps and layers as above):")
    print(format_targets(rows, load_start, load_end))
    note = allocator_note(records)
    if note is not None:
        print(note)
    if args.json:
        payload = {"config": config, "machine": machine_info(), "results": records, "e2e": e2e}
        payload["compiled"] = compiled
        payload["targets"] = {"rows": rows, "load_start": load_start, "load_end": load_end}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"wrote {args.json}")


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("syncbn bench: --device cuda but CUDA is not available")
        return 2
    args.backend = args.backend or default_backend(args.device)
    if args.world_size == 1:  # no group: syncbn is plain batch norm (alone: its synchronised path)
        _rank_main(0, 1, args)
        return 0
    # Ranks compile side by side: give a slower one's compile time before a collective gives up.
    timeout_s = 600.0 if args.compiled else DEFAULT_TIMEOUT_S
    run_ranks(_rank_main, args.world_size, args.backend, args, timeout_s=timeout_s)
    return 0
