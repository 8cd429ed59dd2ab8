"""Real models under torch.compile with syncbn, 2 gloo ranks: recompilations, compiled-op calls, equality.

    python benchmarks/compile/compile_models.py [--backend eager] [--models resnet50,mobilenet_v3_small,...]

For torchvision ``resnet50`` and ``mobilenet_v3_small``, timm ``efficientnet_b0``
and a 50-block Conv-BN-ReLU net, each converted with
``syncbn.convert_sync_batchnorm``, under ``torch.compile(DDP(model))`` and
``DDP(torch.compile(model))``: a warm-up (the first training step and the
first eval call), then training steps with changed per-rank batch sizes and an
eval()/train() switch. Printed per case: graphs compiled during and after the
warm-up (after: should be 0), the syncbn layers, forward and backward
collective-operator calls after the warm-up (should be layers x steps each:
no layer ran eagerly), and the largest difference of the outputs and input
gradients from the same model run eagerly (float64 by default, relative to the
largest magnitude). The model input's batch dimension is marked dynamic.

Not part of the test suite (minutes per model on 2 cores). ``--backend eager``
(the default) stops after dynamo, which is where recompilation is decided;
``--backend inductor`` compiles for real.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

MODELS = ("resnet50", "mobilenet_v3_small", "efficientnet_b0", "blocks50")
WRAPPINGS = ("compile(DDP(m))", "DDP(compile(m))")
SIZES = ((3, 2), (2, 4), (4, 3))  # per-rank batch sizes of the steps after the warm-up
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _build(name: str) -> nn.Module:
    from _helpers import torchvision_shim  # noqa: F401  (torchvision on a CPU torch)

    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=10)
    if name == "mobilenet_v3_small":
        import torchvision

        return torchvision.models.mobilenet_v3_small(num_classes=10)
    if name == "efficientnet_b0":
        import timm

        return timm.create_model("efficientnet_b0", num_classes=10, drop_rate=0.0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(50):
        layers += [nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(nn.Sequential(*layers), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / a.abs().max().clamp(min=1.0))


def _case(model_name: str, wrapping: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import syncbn
    from syncbn.engine import _ops

    torch._dynamo.reset()
    graphs_before = int(counters["stats"]["unique_graphs"])  # the counter runs for the whole process
    eager_m = syncbn.convert_sync_batchnorm(_build(model_name)).to(_DTYPES[args.dtype])
    for module in eager_m.modules():
        if isinstance(module, nn.Dropout):  # random masks would differ between the two runs
            module.p = 0.0
    comp_m = copy.deepcopy(eager_m)
    layers = sum(isinstance(m, syncbn.SyncBatchNorm) for m in comp_m.modules())
    eager = nn.parallel.DistributedDataParallel(eager_m)
    if wrapping == "compile(DDP(m))":
        compiled = torch.compile(nn.parallel.DistributedDataParallel(comp_m), backend=args.backend)
    else:
        compiled = nn.parallel.DistributedDataParallel(torch.compile(comp_m, backend=args.backend))
    worst = 0.0

    def step(i: int, sizes: tuple[int, int]) -> float:
        g = torch.Generator().manual_seed(i)
        x_all = torch.randn(sum(sizes), 3, args.size, args.size, generator=g, dtype=_DTYPES[args.dtype])
        lo = sum(sizes[:rank])
        x = x_all[lo : lo + sizes[rank]]
        outs = []
        for model in (eager, compiled):
            xi = x.clone().requires_grad_()
            torch._dynamo.mark_dynamic(xi, 0)
            y = model(xi)
            y.backward(torch.ones_like(y) + torch.arange(y.shape[-1], dtype=y.dtype))
            outs.append((y, xi.grad))
            model.zero_grad(set_to_none=True)
        return max(_err(outs[0][0], outs[1][0]), _err(outs[0][1], outs[1][1]))

    def evaluate() -> float:
        g = torch.Generator().manual_seed(99)
        x = torch.randn(2, 3, args.size, args.size, generator=g, dtype=_DTYPES[args.dtype])
        for m in (eager, compiled):
            m.eval()
        with torch.no_grad():
            e = _err(eager(x), compiled(x))
        for m in (eager, compiled):
            m.train()
        return e

    start = time.perf_counter()
    worst = max(step(0, (2, 3)), evaluate())
    warm_s = time.perf_counter() - start
    warm_graphs = int(counters["stats"]["unique_graphs"])
    fwd, bwd = _ops.calls, _ops.backward_calls
    for i, sizes in enumerate(SIZES, start=1):
        worst = max(worst, step(i, sizes))
        if i == 1:
            worst = max(worst, evaluate())
    return {
        "layers": layers,
        "warm-up graphs": warm_graphs - graphs_before,
        "warm-up s": warm_s,
        "graphs after": int(counters["stats"]["unique_graphs"]) - warm_graphs,
        "forward calls": _ops.calls - fwd,
        "backward calls": _ops.backward_calls - bwd,
        "worst": worst,
    }


def _worker(rank: int, world: int, tmp: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=900))
    result = {}
    for model_name in args.models.split(","):
        for wrapping in WRAPPINGS:
            result[(model_name, wrapping)] = _case(model_name, wrapping, rank, args)
            if rank == 0:
                print(model_name, wrapping, result[(model_name, wrapping)], flush=True)
    out[rank] = result
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument(
        "--dtype",
        default="float64",
        choices=sorted(_DTYPES),
        help="float64 by default: deep models amplify float32 rounding differences past 1e-5",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(2, tmp, args, out), nprocs=2, start_method="fork")
        results = dict(out)
    print(f"\nW=2 gloo cpu {args.dtype}, backend {args.backend}, torch {torch.__version__}")
    print("model, wrapping, syncbn layers, graphs in warm-up / after, fwd/bwd op calls (expected), worst")
    for key in results[0]:
        r0, r1 = results[0][key], results[1][key]
        expected = r0["layers"] * len(SIZES)
        warm = max(r0["warm-up graphs"], r1["warm-up graphs"])
        print(
            f"{key[0]:>20} {key[1]:>16} {r0['layers']:4d} {warm:3d} / "
            f"{max(r0['graphs after'], r1['graphs after']):3d} "
            f"{r0['forward calls']}/{r0['backward calls']} ({expected}) "
            f"{max(r0['worst'], r1['worst']):.2e} warm-up {max(r0['warm-up s'], r1['warm-up s']):.0f} s"
        )


if __name__ == "__main__":
    main()
