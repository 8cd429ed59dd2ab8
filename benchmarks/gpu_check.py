"""CUDA checks for syncbn: exactness on one GPU shared by 2 gloo ranks, and no host sync.

1. ``equivalence``: 2 ranks (gloo, both on ``cuda:0``) each hold a shard of one
   global batch; syncbn's output, input gradient, summed weight/bias gradients
   and running statistics are compared with float64 ``nn.BatchNorm`` on the
   whole batch (on the GPU).
2. ``no-sync``: one process, syncbn's full synchronised path over a loopback
   group (sum = identity): forward (and separately backward) under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises on any
   device-to-host synchronisation, then a CUDA graph capture and replay of the
   forward, compared with eager.

Exit code 0 only when everything passes; ``--cpu-dry-run`` runs part 1 on the CPU.
Run by ``benchmarks/gpu_check.sh``.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import syncbn
from syncbn.cli.bench import LoopbackGroup

_REF = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
# (name, per-rank sizes, inner shape, input dtype, shift, memory format, tolerance)
CASES: list[tuple[str, list[int], tuple[int, ...], torch.dtype, float, Any, float]] = [
    ("float64-4d-uneven", [3, 5], (8, 6, 6), torch.float64, 0.0, None, 1e-11),
    ("float32-4d", [4, 4], (16, 8, 8), torch.float32, 0.0, None, 2e-5),
    ("float32-2d", [64, 32], (32,), torch.float32, 0.0, None, 2e-5),
    ("float32-5d", [2, 3], (4, 3, 4, 5), torch.float32, 0.0, None, 2e-5),
    ("float32-mean1000", [4, 4], (8, 16, 16), torch.float32, 1000.0, None, 3e-4),
    ("float32-channels-last", [3, 4], (8, 5, 5), torch.float32, 0.0, torch.channels_last, 2e-5),
    ("float16-input", [4, 4], (8, 6, 6), torch.float16, 0.0, None, 4e-3),
    ("bfloat16-input", [4, 4], (8, 6, 6), torch.bfloat16, 0.0, None, 3e-2),
    ("one-rank-empty", [0, 6], (4, 3, 3), torch.float64, 0.0, None, 1e-11),
]


def _case(
    rank: int, sizes: list[int], inner: tuple[int, ...], dtype: torch.dtype, shift: float, fmt: Any, dev: str
) -> float:
    gen = torch.Generator().manual_seed(0)
    total, channels = sum(sizes), inner[0]
    ndim = 1 + len(inner)
    full = (torch.randn(total, *inner, generator=gen, dtype=torch.float64) + shift).to(dtype).double().to(dev)
    grad = torch.randn(total, *inner, generator=gen, dtype=torch.float64).to(dev)
    ref = _REF[ndim](channels).double().to(dev)
    layer_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    ours = syncbn.SyncBatchNorm(channels).to(device=dev, dtype=layer_dtype)
    x_ref = full.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(grad)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    x = full[start:stop].to(dtype)
    g = grad[start:stop].to(dtype)
    if fmt is not None:
        x, g = x.contiguous(memory_format=fmt), g.contiguous(memory_format=fmt)
    x.requires_grad_()
    y = ours(x)
    y.backward(g)
    err = 0.0
    scale = y_ref.abs().max().clamp(min=1).item()
    if x.numel():
        err = max(err, (y.double() - y_ref[start:stop]).abs().max().item() / scale)
        gscale = x_ref.grad.abs().max().clamp(min=1e-12).item()
        err = max(err, (x.grad.double() - x_ref.grad[start:stop]).abs().max().item() / gscale)
        if fmt is not None and not y.is_contiguous(memory_format=fmt):
            err = float("inf")
    gw, gb = ours.weight.grad.double().clone(), ours.bias.grad.double().clone()
    dist.all_reduce(gw)
    dist.all_reduce(gb)
    wscale = max(ref.weight.grad.abs().max().item(), 1.0)
    err = max(err, (gw - ref.weight.grad).abs().max().item() / wscale)
    err = max(err, (gb - ref.bias.grad).abs().max().item() / wscale)
    err = max(err, (ours.running_mean.double() - ref.running_mean).abs().max().item())
    err = max(err, (ours.running_var.double() - ref.running_var).abs().max().item())
    return err


def _equivalence_rank(rank: int, store_path: str, queue: Any, dev: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    results = {}
    for name, sizes, inner, dtype, shift, fmt, _tol in CASES:
        try:
            results[name] = _case(rank, sizes, inner, dtype, shift, fmt, dev)
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[name] = f"{type(exc).__name__}: {exc}"
    queue.put((rank, results))
    dist.destroy_process_group()


def equivalence(dev: str = "cuda:0") -> bool:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_equivalence_rank, args=(r, os.path.join(tmp, "store"), queue, dev))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        got = dict(queue.get() for _ in procs)
        for p in procs:
            p.join(60)
    ok = True
    print(f"equivalence on {dev}, 2 gloo ranks vs float64 nn.BatchNorm on the global batch")
    for name, *_rest, tol in CASES:
        errs = [got[r][name] for r in (0, 1)]
        passed = all(isinstance(e, float) and e <= tol for e in errs)
        ok &= passed
        shown = ", ".join(f"{e:.2e}" if isinstance(e, float) else e for e in errs)
        print(f"  {'PASS' if passed else 'FAIL'} {name:<24} max rel. error per rank: {shown} (tol {tol:g})")
    return ok


def no_sync() -> bool:
    dev = torch.device("cuda", 0)
    ok = True
    print("device-to-host synchronisation (loopback group of 2, full synchronised path)")
    for shape in [(8, 32, 16, 16), (64, 128), (4, 16, 4, 8, 8)]:
        bn = syncbn.SyncBatchNorm(shape[1], process_group=LoopbackGroup()).to(dev)
        x = torch.randn(shape, device=dev, requires_grad=True)
        dy = torch.randn(shape, device=dev)
        bn(x).backward(dy)  # warm up outside the checks
        torch.cuda.synchronize()
        for phase in ("forward", "backward"):
            try:
                if phase == "forward":
                    torch.cuda.set_sync_debug_mode("error")
                    y = bn(x)
                    torch.cuda.set_sync_debug_mode("default")
                else:
                    y = bn(x)
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    y.backward(dy)
                    torch.cuda.set_sync_debug_mode("default")
                print(f"  PASS {phase:<8} {shape}: no synchronisation")
            except RuntimeError as exc:
                torch.cuda.set_sync_debug_mode("default")
                ok = False
                print(f"  FAIL {phase:<8} {shape}: {exc}")
        # CUDA graph capture of the training forward (no autograd recording).
        static_x = torch.randn(shape, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(3):
                    bn(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                static_y = bn(static_x)
            static_x.copy_(torch.randn(shape, device=dev) * 3 + 1)
            graph.replay()
            with torch.no_grad():
                eager = bn(static_x)
            err = (static_y - eager).abs().max().item()
            passed = err <= 1e-5
            ok &= passed
            verdict = "PASS" if passed else "FAIL"
            print(f"  {verdict} graph    {shape}: captured and replayed, |replay - eager| = {err:.1e}")
        except Exception as exc:  # noqa: BLE001 - reported
            ok = False
            print(f"  FAIL graph    {shape}: {type(exc).__name__}: {exc}")
    return ok


def main() -> int:
    if "--cpu-dry-run" in sys.argv:  # exercise the equivalence part without a GPU
        return 0 if equivalence("cpu") else 1
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    ok = no_sync()
    ok = equivalence() and ok
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
