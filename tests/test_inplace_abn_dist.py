"""In-place activated synchronised batch norm on gloo ranks: float64 BN + activation on the global batch.

One launch of 3 ranks runs every case: uneven and empty per-rank batches, each activation, the
compat classes, the native layer and the function, momentum None, no running statistics, eval (no
communication), the collectives' count and size, a channel-strided view as the input (over the
group, and over a group of one: torch's local kernel), and the global-count-one error, an
expanded input and an activation set after construction refused alike on every rank.
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
    # a channel-strided view of a wider tensor as the input (written through to that tensor)
    {"kind": "native", "act": "leaky_relu", "p": 0.1, "sizes": [3, 2, 0], "shape": (3, 4, 2), "view": True},
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
        h = leaf.repeat_interleave(2, dim=1)[:, ::2] if case.get("view") else leaf * 1.0
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
    out.append(_group_of_one_on_a_strided_view(rank, world_size))
    out.append(_faults_before_anything_changes(rank))
    return out


def _group_of_one_on_a_strided_view(rank: int, world_size: int) -> dict[str, float]:
    # A group of one runs torch's local kernel, which read values it had already written over a
    # channel-strided input: a wrong output and wrong running statistics.
    singles = [dist.new_group([r]) for r in range(world_size)]
    layer = syncbn.InPlaceSyncBatchNorm(
        3, process_group=singles[rank], activation="elu", activation_param=0.5
    )
    layer = layer.double()
    gen = torch.Generator().manual_seed(7 + rank)
    with torch.no_grad():
        layer.weight.uniform_(-1.5, 1.5, generator=gen)
        layer.bias.normal_(generator=gen)
    x = torch.randn(5, 6, 4, generator=gen, dtype=torch.float64) * 2.0 + 1.0
    grad = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    running = (layer.running_mean.clone(), layer.running_var.clone())
    ref = reference(x[:, ::2], grad, layer.weight, layer.bias, running, activation="elu", param=0.5)
    leaf = x.clone().requires_grad_()
    h = (leaf * 1.0)[:, ::2]
    y = layer(h)
    assert y is h
    y.backward(grad)
    assert torch.equal(leaf.grad[:, 1::2], torch.zeros(5, 3, 4, dtype=torch.float64))
    return {
        "y": max_error(y, ref["y"]),
        "dx": max_error(leaf.grad[:, ::2], ref["dx"]),
        "dw": max_error(layer.weight.grad, ref["dw"]),
        "rm": max_error(layer.running_mean, ref["rm"]),
        "rv": max_error(layer.running_var, ref["rv"]),
    }


def _faults_before_anything_changes(rank: int) -> dict[str, Any]:
    # Every rank raises the same error before any collective and any state change; the next
    # valid step then runs over the whole group (no rank was left inside a collective).
    layer = syncbn.InPlaceSyncBatchNorm(3).double()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    errors = []
    try:
        layer(torch.randn(2, 3, 1, dtype=torch.float64).expand(2, 3, 4))
    except RuntimeError as exc:
        errors.append(str(exc).split(" (")[0])
    layer.activation, layer.activation_param = "elu", 0.0
    try:
        layer(torch.randn(2, 3, 4, dtype=torch.float64))
    except ValueError as exc:
        errors.append(str(exc).split(" (")[0])
    unchanged = all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    layer.activation_param = 1.0
    layer(torch.randn(2 + rank, 3, 4, dtype=torch.float64))
    return {"errors": errors, "unchanged": unchanged, "steps": int(layer.num_batches_tracked)}


def test_equals_global_batchnorm_and_activation_on_every_rank() -> None:
    results = launch(_all_cases, WORLD, timeout=100)
    for rank, per_rank in enumerate(results):
        for case, errors in zip(CASES, per_rank[: len(CASES)]):
            worst = max(errors.values())
            assert worst <= TOL, f"rank {rank}, case {case}: {errors}"
    for rank, per_rank in enumerate(results):
        single = per_rank[len(CASES) + 1]
        assert max(single.values()) <= TOL, f"rank {rank}, a group of one on a strided view: {single}"
    faults = [per_rank[len(CASES) + 2] for per_rank in results]
    assert all(f == faults[0] for f in faults), faults
    assert faults[0]["unchanged"] and faults[0]["steps"] == 1, faults[0]
    assert [e[:60] for e in faults[0]["errors"]] == [
        "in-place activated batch norm overwrites its input, which he",
        "expected a positive, finite activation_param",
    ], faults[0]
    messages = {r[len(CASES)] for r in results}
    assert len(messages) == 1, messages
    text, unchanged = messages.pop()
    assert text.startswith("Expected more than 1 value per channel when training") and unchanged
