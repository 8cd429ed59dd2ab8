"""Timing loop of ``syncbn bench`` (shared with ``benchmarks/``): interleaved methods, the slowest rank."""

from __future__ import annotations

import os
import platform
import statistics
import time
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._bench_methods import METHODS, build, collective_buffers
from ._bench_report import load_average, ratios
from ._launch import gather

try:  # per-thread resource usage: Linux
    import resource

    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # Windows
    _RUSAGE_THREAD = None

__all__ = ["bench_layers", "machine_info", "time_interleaved", "training_step", "two_sums"]

Step = Callable[[], Any]


def time_interleaved(
    steps: dict[str, Step],
    iters: int,
    warmup: int,
    *,
    barrier: bool,
    cuda: bool,
    cpu_times: dict[str, list[float]] | None = None,
    faults: dict[str, list[int]] | None = None,
) -> dict[str, list[float]]:
    """Time each callable ``warmup + iters`` times, interleaved (after an untimed barrier with ``barrier``).
    Wall seconds of the timed calls; ``cpu_times`` receives the thread's CPU seconds per call (no waiting
    counted), ``faults`` its minor page faults per call where the platform counts them (Linux)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for it in range(warmup + iters):
        for name, step in steps.items():
            if barrier:
                dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            faults_start = _minor_faults()
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
                if faults is not None and faults_start is not None:
                    faults.setdefault(name, []).append((_minor_faults() or 0) - faults_start)
    return times


def _minor_faults() -> int | None:
    return None if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD).ru_minflt


def two_sums(channels: int, device: torch.device, reduce: Callable[[Tensor], Any] | None) -> Step:
    """One step of the two sums syncbn makes (``2C + 1`` and ``2C`` float64 values) through ``reduce``."""
    fwd, bwd = collective_buffers(channels, device, torch.float64)

    def step() -> None:
        if reduce is not None:
            reduce(fwd)
            reduce(bwd)

    return step


def _layer_steps(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rank: int
) -> tuple[dict[str, Step], Tensor, Tensor]:
    """Each method's step on this rank's input of ``shape``; the input and upstream gradient."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x_data = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    steps: dict[str, Step] = {}
    for method in METHODS:
        if method == "2xAR":
            steps[method] = two_sums(shape[1], device, dist.all_reduce if dist.is_initialized() else None)
        elif (mod := build(method, x_data)) is not None:
            if dtype in (torch.float16, torch.bfloat16) and not x_data.is_cuda and method == "naive":
                mod = mod.to(dtype)
            steps[method] = training_step(mod, x_data, dy)
    return steps, x_data, dy


def training_step(mod: nn.Module, x_data: Tensor, dy: Tensor) -> Step:
    """``mod``'s training forward on a copy of ``x_data``, backward with ``dy``, gradients cleared first."""
    x = x_data.clone().requires_grad_(True)

    def step() -> None:
        x.grad = None
        mod.zero_grad(set_to_none=True)
        mod(x).backward(dy)

    return step


def bench_layers(
    rank: int,
    shapes: list[tuple[int, ...]],
    *,
    iters: int,
    warmup: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    extra: Callable[[Tensor, Tensor], dict[str, Step]] | None = None,
) -> list[dict[str, Any]]:
    """Time every method on every shape, on every rank of the default group (or alone, without one).

    One record per shape, the same on every rank, of the slowest (worst) rank's medians, ratios and
    page faults per call; ``extra(x, dy)`` adds steps (``benchmarks/speed/layers.py``'s methods).
    """
    device = device or torch.device("cpu")
    distributed, cuda = dist.is_initialized(), device.type == "cuda"
    records = []
    for shape in shapes:
        steps, x_data, dy = _layer_steps(shape, dtype, device, rank)
        steps |= extra(x_data, dy) if extra else {}
        timed = partial(time_interleaved, steps, iters, warmup, barrier=distributed, cuda=cuda)
        cpu: dict[str, list[float]] = {}  # thread CPU seconds and page faults per call
        faults: dict[str, list[int]] = {}
        error = None
        try:
            times = timed(cpu_times=cpu, faults=faults)
        except Exception as exc:  # e.g. a backend without the collective torch's SyncBN needs
            steps.pop("torch", None)
            error = f"torch.nn.SyncBatchNorm failed: {type(exc).__name__}: {exc}"
            cpu, faults = {}, {}
            times = timed(cpu_times=cpu, faults=faults)
        mine = {
            "wall": {name: statistics.median(ts) * 1e3 for name, ts in times.items()},
            "cpu": {name: statistics.median(ts) * 1e3 for name, ts in cpu.items()},
            "faults": {name: statistics.mean(fs) for name, fs in faults.items()},
        }
        gathered = gather(mine)
        worst = {kind: {name: max(r[kind][name] for r in gathered) for name in mine[kind]} for kind in mine}
        records.append(
            {
                "shape": list(shape),
                "median_ms": worst["wall"],
                "cpu_median_ms": worst["cpu"],
                "faults_per_call": worst["faults"],
                "per_rank_median_ms": [r["wall"] for r in gathered],
                "per_rank_cpu_median_ms": [r["cpu"] for r in gathered],
                "ratios": ratios(worst["wall"]),
                "cpu_ratios": ratios(worst["cpu"]),
                "error": error,
            }
        )
    return records


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": load_average(),
    }
