"""In-place activated synchronised batch norm on gloo ranks: float64 BN + activation on the global batch.

One launch of 3 ranks runs every case: uneven and empty per-rank batches, each activation, the
compat classes, the native layer and the function, momentum None, no running statistics, eval (no
communication), the collectives' count and size, and the global-count-one error on every rank.
torch.compile, DistributedDataParallel, DataParallel and Join, the same for every family, are in
``test_family_matrix.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import syncbn
from _helpers.abn_reference import max_error, reference
from _helpers.dist_harness import launch
from _helpers.modules import CountingGroup
from syncbn.compat.inplace_abn import InPlaceABNSync, inplace_abn_sync

pytestmark = pytest.mark.timeout(120)

WORLD = 3
TOL = 1e-12


CASES: list[dict[str, Any]] = [
    {"kind": "compat", "act": "leaky_relu", "p": 0.01, "sizes": [3, 0, 2], "shape": (4, 3, 3)},
    {"kind": "native", "act": "elu", "p": 1.0, "sizes": [1, 4, 2], "shape": (3, 5), "momentum": None},
    {"kind": "native", "act": "identity", "p": 0.0, "sizes": [2, 2, 0], "shape": (2, 3, 2), "affine": False},
    {"kind": "compat", "act": "leaky_relu", "p": 0.2, "sizes": [0, 3, 3], "shape": (3, 4), "track": False},
    {"kind": "function", "act": "elu", "p": 0.7, "sizes": [2, 1, 3], "shape": (5, 2, 2)},
]


def _layer(case: dict[str, Any], channels: int, group: Any) -> Any:
    kwargs = {
        "momentum": case.get("momentum", 0.1),
        "affine": case.get("affine", True),
        "track_running_stats": case.get("track", True),
        "activation": case["act"],
        "activation_param": case["p"],
    }
    if case["kind"] == "compat":
        return InPlaceABNSync(channels, group=group, **kwargs).double()
    return syncbn.InPlaceSyncBatchNorm(channels, process_group=group, **kwargs).double()


def _run_case(rank: int, case: dict[str, Any], index: int) -> dict[str, float]:
    sizes, shape = case["sizes"], case["shape"]
    channels = shape[0]
    gen = torch.Generator().manual_seed(100 + index)
    weight = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.3
    weight[0] = -weight[0]  # a negative weight: scale |w| + eps, gradient sign -1
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    errors: dict[str, float] = {}
    group = CountingGroup()
    layer = _layer(case, channels, group) if case["kind"] != "function" else None
    if layer is not None and layer.weight is not None:
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    affine = layer is None or layer.weight is not None
    running = (torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64))
    if layer is not None and layer.running_mean is not None:
        running = (layer.running_mean, layer.running_var)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    fn_running = (running[0].clone(), running[1].clone())
    ref_running: tuple[torch.Tensor, torch.Tensor] | None = (running[0].clone(), running[1].clone())
    if case.get("track", True) is False:
        ref_running = None
    for step in range(2):
        x = torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64) * 1.5 + 3.0
        grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        momentum = case.get("momentum", 0.1)
        ref = reference(
            x,
            grad,
            weight if affine else None,
            bias if affine else None,
            ref_running,
            momentum=1.0 / (step + 1) if momentum is None else momentum,
            activation=case["act"],
            param=case["p"],
        )
        if ref_running is not None:
            ref_running = (ref["rm"], ref["rv"])
        leaf = x[start:stop].clone().requires_grad_()
        w = weight.clone().requires_grad_() if layer is None else None
        b = bias.clone().requires_grad_() if layer is None else None
        group.calls.clear()
        h = leaf * 1.0
        if layer is None:
            y = inplace_abn_sync(h, w, b, *fn_running, True, 0.1, 1e-5, case["act"], case["p"], group=group)
        else:
            y = layer(h)
        assert y is h, "the output is the input tensor"
        y.backward(grad[start:stop])
        assert group.calls == [2 * channels + 1, 2 * channels], group.calls
        errors[f"y{step}"] = max_error(y, ref["y"][start:stop])
        errors[f"dx{step}"] = max_error(leaf.grad, ref["dx"][start:stop])
        params = (w, b) if layer is None else (layer.weight, layer.bias)
        for name, p, key in (("dw", params[0], "dw"), ("db", params[1], "db")):
            if p is None:
                assert ref[key] is None
                continue
            total = p.grad.clone()
            dist.all_reduce(total)  # the local shares sum to the global gradient
            errors[f"{name}{step}"] = max_error(total, ref[key])
            p.grad = None
        if ref_running is not None:
            mine = fn_running if layer is None else (layer.running_mean, layer.running_var)
            errors[f"rm{step}"] = max_error(mine[0], ref["rm"])
            errors[f"rv{step}"] = max_error(mine[1], ref["rv"])
    if layer is not None:
        # Eval never communicates (running statistics, or the local batch's without them).
        layer.eval()
        group.calls.clear()
        x = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
        layer(x.clone().requires_grad_() * 1.0).sum().backward()
        assert group.calls == [], group.calls
        if layer.track_running_stats:
            assert int(layer.num_batches_tracked) == 2
    return errors


def _all_cases(rank: int, world_size: int) -> list[Any]:
    out: list[Any] = [_run_case(rank, case, i) for i, case in enumerate(CASES)]
    # Global count one: every rank raises the same error, before anything changes.
    layer = InPlaceABNSync(3).double()
    before = layer.state_dict()
    x = torch.randn(1 if rank == 0 else 0, 3, dtype=torch.float64)
    try:
        layer(x * 1.0)
        out.append("no error")
    except ValueError as exc:
        unchanged = all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
        out.append((str(exc).split(" (")[0], unchanged))
    return out


def test_equals_global_batchnorm_and_activation_on_every_rank() -> None:
    results = launch(_all_cases, WORLD, timeout=100)
    for rank, per_rank in enumerate(results):
        for case, errors in zip(CASES, per_rank[: len(CASES)]):
            worst = max(errors.values())
            assert worst <= TOL, f"rank {rank}, case {case}: {errors}"
    messages = {r[-1] for r in results}
    assert len(messages) == 1, messages
    text, unchanged = messages.pop()
    assert text.startswith("Expected more than 1 value per channel when training") and unchanged
