"""``python -m syncbn bench``: per-layer forward+backward timing on W ranks.

Every rank times, interleaved in one loop so that machine noise hits all of
them alike, one training forward + backward (random upstream gradient) of:

* ``local``: ``nn.BatchNorm`` with no synchronisation (the floor's compute part);
* ``2xAR``: two small ``torch.distributed.all_reduce`` calls of ``2C + 1`` and
  ``2C`` float64 values (the floor's communication part: what syncbn must send
  anyway), through the process group's transport (gloo on CPU);
* ``2xAR-shm``: the same two sums through syncbn's own collective path, which
  on CPU with every rank on one machine is the shared-memory all_reduce;
* ``local+AR``: ``nn.BatchNorm`` with those two ``all_reduce`` calls made where
  syncbn makes them, one after its forward and one inside its backward. This
  is the floor as a real step meets it: each collective also waits for the
  slower rank's compute, which back-to-back ``2xAR`` never does;
* ``syncbn``: :class:`syncbn.SyncBatchNorm` (shared memory where available);
* ``syncbn-pg``: :class:`syncbn.SyncBatchNorm` with shared memory off, so its
  collectives take the same transport as ``2xAR`` (CPU only);
* ``naive``: the common naive algorithm (per-channel mean and mean of squares,
  all-reduced with autograd, normalisation by broadcasting arithmetic);
* ``torch``: ``torch.nn.SyncBatchNorm`` where it runs (CUDA input only).

Each rank's median is taken over the timed iterations, and the table shows the
slowest rank's median for each method, with the ratios
``syncbn / (local + 2xAR)`` (the floor), ``syncbn / (local + 2xAR-shm)`` (the
floor on syncbn's own transport), ``syncbn-pg / (local+AR)`` (the algorithm
against the floor on the same transport, collectives in place),
``syncbn / naive`` and ``syncbn / torch``.
``--json PATH`` writes every number. The ``benchmarks/`` scripts call the same
code (:func:`bench_layers`, :func:`time_interleaved`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._function import SyncBatchNormFunction
from ..groups import ProcessGroupSum
from ..modules import SyncBatchNorm
from ._launch import run_ranks

__all__ = [
    "DEFAULT_SHAPES",
    "LoopbackGroup",
    "NaiveSyncBatchNorm",
    "add_arguments",
    "bench_layers",
    "format_table",
    "machine_info",
    "parse_shapes",
    "run",
    "time_interleaved",
]

DEFAULT_SHAPES: list[tuple[int, ...]] = [
    (16, 64, 32, 32),
    (32, 256, 8, 8),
    (256, 512),
    (4, 32, 8, 16, 16),
    (32, 64, 56, 56),
]

METHODS = ("local", "2xAR", "2xAR-shm", "local+AR", "syncbn", "syncbn-pg", "naive", "torch")


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"16x64x32x32,256x512"`` -> ``[(16, 64, 32, 32), (256, 512)]``."""
    shapes = []
    for part in text.split(","):
        dims = tuple(int(d) for d in part.strip().lower().split("x"))
        if len(dims) < 2 or any(d <= 0 for d in dims):
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: expected e.g. 16x64x32x32")
        shapes.append(dims)
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=DEFAULT_SHAPES,
        help="comma-separated per-rank input shapes, e.g. 16x64x32x32,256x512 (default: five standard ones)",
    )
    parser.add_argument("--iters", type=int, default=40, help="timed iterations per method (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--force-sync",
        action="store_true",
        help="with --world-size 1, run the synchronised code paths anyway (group of one)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every number to this JSON file")


# --------------------------------------------------------------------------- methods


class LoopbackGroup:
    """A two-member :class:`~syncbn.groups.SumGroup` whose sum is the identity.

    Runs syncbn's whole synchronised code path in one process (for memory
    measurements and device-synchronisation checks); the statistics are then the
    local batch's, so the result equals ``nn.BatchNorm``'s.
    """

    size = 2
    rank = 0

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor


class _AllReduceMean(torch.autograd.Function):
    """``all_reduce`` average whose backward averages the gradient the same way."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, world: int) -> Tensor:  # type: ignore[override]
        out = tensor.clone()
        dist.all_reduce(out)
        ctx.world = world
        return out.div_(world)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad.div_(ctx.world), None


class NaiveSyncBatchNorm(nn.Module):
    """The common naive synchronised batch norm, for comparison only.

    Per-channel mean and mean of squares in the input dtype, averaged over
    ranks by an autograd-aware ``all_reduce``, ``var = E[x^2] - E[x]^2``, and
    normalisation by broadcasting arithmetic that autograd differentiates.
    Ranks are weighted equally (right for equal per-rank batches only).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        world = dist.get_world_size() if dist.is_initialized() else 1
        mean = x.mean(dims)
        meansq = (x * x).mean(dims)
        stats = torch.cat([mean, meansq])
        if world > 1:
            stats = _AllReduceMean.apply(stats, world)
        mean, meansq = stats.split(channels)
        var = meansq - mean * mean
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        shift = self.bias - mean * scale
        with torch.no_grad():
            n = x.numel() // channels * world
            running_mean, running_var = self.get_buffer("running_mean"), self.get_buffer("running_var")
            running_mean.lerp_(mean.detach().to(running_mean.dtype), self.momentum)
            unbiased = var.detach() * (n / max(n - 1, 1))
            running_var.lerp_(unbiased.to(running_var.dtype), self.momentum)
        return x * scale.view(shape) + shift.view(shape)


class _CollectivesAround(torch.autograd.Function):
    """Identity that all-reduces ``fwd`` in forward and ``bwd`` in backward."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, fwd: Tensor, bwd: Tensor) -> Tensor:  # type: ignore[override]
        if dist.is_initialized():
            dist.all_reduce(fwd)
        ctx.bwd = bwd
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        if dist.is_initialized():
            dist.all_reduce(ctx.bwd)
        return grad, None, None


class LocalWithCollectives(nn.Module):
    """Local ``nn.BatchNorm`` plus syncbn's two all-reduces at the same points (the real floor)."""

    def __init__(self, bn: nn.Module, channels: int, device: torch.device) -> None:
        super().__init__()
        self.bn = bn
        self.fwd = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
        self.bwd = torch.zeros(2 * channels, dtype=torch.float64, device=device)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _CollectivesAround.apply(self.bn(x), self.fwd, self.bwd)
        return out


def _local_bn(dim: int, channels: int) -> nn.Module:
    if dim == 2 or dim == 3:
        return nn.BatchNorm1d(channels)
    if dim == 4:
        return nn.BatchNorm2d(channels)
    return nn.BatchNorm3d(channels)


class _ForcedSync(nn.Module):
    """Run a synchronised autograd function directly, even on a group of one."""

    def __init__(self, bn: nn.Module, kind: str) -> None:
        super().__init__()
        self.bn = bn
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        bn = self.bn
        if self.kind == "syncbn":
            return SyncBatchNormFunction.apply(  # type: ignore[no-any-return]
                x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, ProcessGroupSum()
            )
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFn

        group = dist.group.WORLD
        return TorchSyncFn.apply(  # type: ignore[no-untyped-call, no-any-return]
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, group, 1
        )


def _build(method: str, x: Tensor, force_sync: bool) -> nn.Module | None:
    channels = x.shape[1]
    if method == "local":
        mod: nn.Module = _local_bn(x.dim(), channels)
    elif method == "local+AR":
        mod = LocalWithCollectives(_local_bn(x.dim(), channels), channels, x.device)
    elif method == "syncbn":
        mod = SyncBatchNorm(channels)
        if force_sync:
            mod = _ForcedSync(mod, "syncbn")
    elif method == "syncbn-pg":
        if x.is_cuda or not dist.is_initialized() or force_sync:
            return None  # only CPU collectives have the shared-memory path to turn off
        mod = SyncBatchNorm(channels, process_group=ProcessGroupSum(None, shared_memory=False))
    elif method == "naive":
        mod = NaiveSyncBatchNorm(channels)
    elif method == "torch":
        if not x.is_cuda:
            return None  # torch.nn.SyncBatchNorm raises on CPU tensors
        mod = nn.SyncBatchNorm(channels)
        if force_sync:
            mod = _ForcedSync(mod, "torch")
    else:
        raise ValueError(method)
    return mod.to(device=x.device).train()


def time_interleaved(
    steps: dict[str, Callable[[], Any]],
    iters: int,
    warmup: int,
    *,
    barrier: bool,
    cuda: bool,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Time each callable ``warmup + iters`` times, interleaved; wall seconds of the timed ones.

    With ``barrier``, every call starts after a ``dist.barrier()`` (untimed), so
    ranks start each measurement together. ``cpu_times``, when given, receives
    the calling thread's CPU seconds per call: the compute cost, which time spent
    waiting for peers or for a busy machine's scheduler does not inflate.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for it in range(warmup + iters):
        for name, step in steps.items():
            if barrier:
                dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            cpu_start = time.thread_time()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            cpu = time.thread_time() - cpu_start
            if it >= warmup:
                times[name].append(elapsed)
                if cpu_times is not None:
                    cpu_times.setdefault(name, []).append(cpu)
    return times


def _two_sums(
    channels: int, device: torch.device, reduce: Callable[[Tensor], Any] | None
) -> Callable[[], None]:
    """One step of the two sums syncbn makes (``2C + 1`` and ``2C`` float64 values) through ``reduce``."""
    fwd = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    bwd = torch.zeros(2 * channels, dtype=torch.float64, device=device)

    def step() -> None:
        if reduce is not None:
            reduce(fwd)
            reduce(bwd)

    return step


def _layer_steps(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rank: int, force_sync: bool
) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    x_data = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    channels = shape[1]
    steps: dict[str, Callable[[], Any]] = {}
    for method in METHODS:
        if method == "2xAR":
            steps[method] = _two_sums(channels, device, dist.all_reduce if dist.is_initialized() else None)
            continue
        if method == "2xAR-shm":
            if not dist.is_initialized() or device.type != "cpu" or force_sync:
                continue
            steps[method] = _two_sums(channels, device, ProcessGroupSum(None).all_reduce_sum)
            continue
        mod = _build(method, x_data, force_sync)
        if mod is None:
            continue
        if dtype in (torch.float16, torch.bfloat16) and not x_data.is_cuda and method == "naive":
            mod = mod.to(dtype)
        x = x_data.clone().requires_grad_(True)

        def step(mod: nn.Module = mod, x: Tensor = x) -> None:
            x.grad = None
            mod.zero_grad(set_to_none=True)
            mod(x).backward(dy)

        steps[method] = step
    return steps


def bench_layers(
    rank: int,
    world_size: int,
    shapes: list[tuple[int, ...]],
    *,
    iters: int,
    warmup: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    force_sync: bool = False,
) -> list[dict[str, Any]]:
    """Time every method on every shape on this rank; every rank returns the slowest-rank medians.

    Must run on every rank of an initialised default group (or in a single
    process without one). Returns one record per shape with ``median_ms`` per
    method (the largest over ranks), ``per_rank_median_ms`` and ``ratios``.
    """
    device = device or torch.device("cpu")
    distributed = dist.is_initialized()
    records = []
    for shape in shapes:
        steps = _layer_steps(shape, dtype, device, rank, force_sync)
        cuda = device.type == "cuda"
        cpu: dict[str, list[float]] = {}
        try:
            times = time_interleaved(steps, iters, warmup, barrier=distributed, cuda=cuda, cpu_times=cpu)
            error = None
        except Exception as exc:  # e.g. a backend without the collective torch's SyncBN needs
            steps.pop("torch", None)
            cpu = {}
            times = time_interleaved(steps, iters, warmup, barrier=distributed, cuda=cuda, cpu_times=cpu)
            error = f"torch.nn.SyncBatchNorm failed: {type(exc).__name__}: {exc}"
        mine = {
            "wall": {name: statistics.median(ts) * 1e3 for name, ts in times.items()},
            "cpu": {name: statistics.median(ts) * 1e3 for name, ts in cpu.items()},
        }
        if distributed:
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        slowest = {name: max(r["wall"][name] for r in gathered) for name in mine["wall"]}
        slowest_cpu = {name: max(r["cpu"][name] for r in gathered) for name in mine["cpu"]}
        records.append(
            {
                "shape": list(shape),
                "median_ms": slowest,
                "cpu_median_ms": slowest_cpu,
                "per_rank_median_ms": [r["wall"] for r in gathered],
                "per_rank_cpu_median_ms": [r["cpu"] for r in gathered],
                "ratios": ratios(slowest),
                "cpu_ratios": ratios(slowest_cpu),
                "error": error,
            }
        )
    return records


def ratios(ms: dict[str, float]) -> dict[str, float | None]:
    """The headline ratios from one shape's medians (``None`` where a method did not run)."""
    floor = ms["local"] + ms.get("2xAR", 0.0)
    sync = ms["syncbn"]
    own_floor = ms["local"] + ms["2xAR-shm"] if "2xAR-shm" in ms else None
    out: dict[str, float | None] = {
        "floor_ms": floor,
        "syncbn_over_floor": sync / floor,
        "own_floor_ms": own_floor,
        "syncbn_over_own_floor": sync / own_floor if own_floor else None,
        "syncbn_over_interleaved_floor": sync / ms["local+AR"] if "local+AR" in ms else None,
        "syncbn_pg_over_interleaved_floor": (
            ms["syncbn-pg"] / ms["local+AR"] if "syncbn-pg" in ms and "local+AR" in ms else None
        ),
        "syncbn_over_naive": sync / ms["naive"] if "naive" in ms else None,
        "syncbn_over_torch": sync / ms["torch"] if "torch" in ms else None,
        "naive_over_local": ms["naive"] / ms["local"] if "naive" in ms else None,
    }
    return out


def format_table(records: list[dict[str, Any]], kind: str = "median_ms") -> str:
    """A plain-text table of slowest-rank medians (ms) and ratios.

    ``kind`` is ``"median_ms"`` (wall clock) or ``"cpu_median_ms"`` (thread CPU time).
    """
    ratio_key = "ratios" if kind == "median_ms" else "cpu_ratios"
    head = (
        f"{'shape':>16} {'local':>7} {'2xAR':>6} {'2xAR-shm':>8} {'local+AR':>8} {'syncbn':>7} {'sync-pg':>7}"
        f" {'naive':>7} {'torch':>7} {'s/floor':>7} {'s/floor-shm':>11} {'pg/l+AR':>7} {'s/naive':>7}"
        f" {'s/torch':>7}"
    )
    lines = [head, "-" * len(head)]

    def cell(value: float | None, width: int, fmt: str) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    for rec in records:
        ms, r = rec[kind], rec[ratio_key]
        shape = "x".join(str(d) for d in rec["shape"])
        lines.append(
            f"{shape:>16} {ms['local']:>7.3f} {ms.get('2xAR', 0.0):>6.3f}"
            f" {cell(ms.get('2xAR-shm'), 8, '.3f')} {cell(ms.get('local+AR'), 8, '.3f')}"
            f" {ms['syncbn']:>7.3f} {cell(ms.get('syncbn-pg'), 7, '.3f')}"
            f" {cell(ms.get('naive'), 7, '.3f')} {cell(ms.get('torch'), 7, '.3f')}"
            f" {r['syncbn_over_floor']:>7.3f} {cell(r.get('syncbn_over_own_floor'), 11, '.3f')}"
            f" {cell(r.get('syncbn_pg_over_interleaved_floor'), 7, '.3f')}"
            f" {cell(r['syncbn_over_naive'], 7, '.3f')} {cell(r['syncbn_over_torch'], 7, '.3f')}"
        )
        if rec.get("error"):
            lines.append(f"    note: {rec['error']}")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    return info


# --------------------------------------------------------------------------- command


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    records = bench_layers(
        rank,
        world_size,
        args.shapes,
        iters=args.iters,
        warmup=args.warmup,
        dtype=getattr(torch, args.dtype),
        device=device,
        force_sync=args.force_sync,
    )
    if rank != 0:
        return
    config = {
        "world_size": world_size,
        "iters": args.iters,
        "warmup": args.warmup,
        "dtype": args.dtype,
        "device": args.device,
        "backend": args.backend,
        "threads_per_rank": args.threads,
        "force_sync": bool(args.force_sync),
        "statistic": "median over iterations per rank, then the slowest rank",
    }
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
    if args.json:
        payload = {"config": config, "machine": machine_info(), "results": records}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"wrote {args.json}")


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("syncbn bench: --device cuda but CUDA is not available")
        return 2
    if args.world_size == 1 and not args.force_sync:
        # No group: syncbn is plain batch norm; still a useful single-process timing.
        _rank_main(0, 1, args)
        return 0
    run_ranks(_rank_main, args.world_size, args.backend, args)
    return 0
