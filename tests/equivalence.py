"""Equivalence cases: syncbn on W ranks vs ``nn.BatchNorm`` on the global batch in float64.

Every rank builds the same global batch and upstream gradient from one seed,
takes its shard, and compares with a float64 ``nn.BatchNorm`` run on the whole
batch in the same process. Results are error magnitudes, compared with
tolerances by the tests in the parent process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import syncbn

_REF = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
_OURS = {
    2: syncbn.SyncBatchNorm1d,
    3: syncbn.SyncBatchNorm1d,
    4: syncbn.SyncBatchNorm2d,
    5: syncbn.SyncBatchNorm3d,
}


@dataclass
class Case:
    """One equivalence scenario."""

    name: str
    sizes: list[int]  # per-rank batch sizes, one per rank of the group
    inner: tuple[int, ...] = (4, 5)  # (C, *spatial)
    dtype: torch.dtype = torch.float64
    layer_dtype: torch.dtype | None = None  # defaults to float32 for low-precision input
    kwargs: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    shift: float = 0.0
    memory_format: torch.memory_format | None = None
    steps: int = 2
    generic: bool = False  # use syncbn.SyncBatchNorm instead of the 1d/2d/3d class
    subgroup: int | None = None  # new_subgroups(k)
    seed: int = 0


def _layer_dtype(case: Case) -> torch.dtype:
    if case.layer_dtype is not None:
        return case.layer_dtype
    return torch.float32 if case.dtype in (torch.float16, torch.bfloat16) else case.dtype


def run_case(case: Case, rank: int, group: Any = None, group_rank: int | None = None) -> dict[str, float]:
    """Run ``case`` on this rank; return the largest errors against the reference."""
    group_rank = rank if group_rank is None else group_rank
    gen = torch.Generator().manual_seed(case.seed)
    channels = case.inner[0]
    total = sum(case.sizes)
    start = sum(case.sizes[:group_rank])
    stop = start + case.sizes[group_rank]
    kwargs = dict(case.kwargs)

    ndim = 2 + len(case.inner) - 1
    ref = _REF.get(ndim, nn.BatchNorm1d)(channels, **kwargs).double()
    cls = syncbn.SyncBatchNorm if case.generic else _OURS[ndim]
    ours = cls(channels, process_group=group, **kwargs).to(_layer_dtype(case))
    with torch.no_grad():
        if ref.weight is not None:
            w = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
            b = torch.randn(channels, generator=gen, dtype=torch.float64)
            ref.weight.copy_(w)
            ref.bias.copy_(b)
            ours.weight.copy_(w)
            ours.bias.copy_(b)
        if ref.running_mean is not None:
            rm = torch.randn(channels, generator=gen, dtype=torch.float64)
            rv = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
            ref.running_mean.copy_(rm)
            ref.running_var.copy_(rv)
            ours.running_mean.copy_(rm)
            ours.running_var.copy_(rv)

    errors: dict[str, float] = {}

    def note(key: str, value: float) -> None:
        errors[key] = max(errors.get(key, 0.0), value)

    for _ in range(case.steps):
        full = torch.randn(total, *case.inner, generator=gen, dtype=torch.float64) * case.scale + case.shift
        full = full.to(case.dtype).double()  # the reference sees exactly the values we feed
        grad = torch.randn(total, *case.inner, generator=gen, dtype=torch.float64)

        ref.zero_grad()
        ours.zero_grad()
        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref.flatten(2)).view_as(x_ref) if ndim > 5 else ref(x_ref)
        y_ref.backward(grad)

        x = full[start:stop].to(case.dtype)
        if case.memory_format is not None:
            x = x.contiguous(memory_format=case.memory_format)
        x.requires_grad_()
        y = ours(x)
        g = grad[start:stop].to(case.dtype)
        if case.memory_format is not None:
            g = g.contiguous(memory_format=case.memory_format)
        y.backward(g)

        assert y.dtype == case.dtype, (y.dtype, case.dtype)
        assert y.shape == x.shape
        if case.memory_format is not None and x.numel() > 0:
            assert y.is_contiguous(memory_format=case.memory_format), "output lost memory format"
        assert x.grad is not None
        out_scale = y_ref.detach().abs().max().clamp(min=1).item() if total else 1.0
        if x.numel():
            note("output", (y.double() - y_ref[start:stop]).abs().max().item() / out_scale)
            gscale = x_ref.grad.abs().max().clamp(min=1e-12).item()
            note("grad_input", (x.grad.double() - x_ref.grad[start:stop]).abs().max().item() / gscale)
        note("nan", float(not bool(torch.isfinite(y).all() and torch.isfinite(x.grad).all())))
        if ours.weight is not None:
            gw = ours.weight.grad.detach().double().clone()
            gb = ours.bias.grad.detach().double().clone()
            dist.all_reduce(gw, group=group)
            dist.all_reduce(gb, group=group)
            wscale = max(ref.weight.grad.abs().max().item(), ref.bias.grad.abs().max().item(), 1.0)
            note("grad_weight", (gw - ref.weight.grad).abs().max().item() / wscale)
            note("grad_bias", (gb - ref.bias.grad).abs().max().item() / wscale)
        if ref.running_mean is not None:
            note("running_mean", (ours.running_mean.double() - ref.running_mean).abs().max().item())
            note("running_var", (ours.running_var.double() - ref.running_var).abs().max().item())
            note(
                "num_batches_tracked",
                float(abs(int(ours.num_batches_tracked) - int(ref.num_batches_tracked))),
            )
    return errors


def tolerance(case: Case) -> float:
    """Acceptable relative error for the case's input dtype."""
    if case.dtype == torch.float64:
        return 1e-12 * max(1.0, case.shift / case.scale) * 10
    if case.dtype == torch.float32:
        return 2e-5 if case.shift == 0 else 3e-4
    if case.dtype == torch.float16:
        return 4e-3
    return 3e-2  # bfloat16


def standard_cases(world_size: int) -> list[Case]:
    """The matrix of shapes, batch splits, options and dtypes for ``world_size`` ranks."""
    w = world_size
    even = [3] * w
    uneven = [i + 1 for i in range(w)]
    one_empty = [0] + [3] * (w - 1)
    cases = [
        Case("2d-even", even, inner=(6,)),
        Case("3d-uneven", uneven, inner=(4, 7)),
        Case("4d-uneven", uneven, inner=(4, 3, 5)),
        Case("5d-even", even, inner=(3, 2, 3, 4)),
        Case("generic-6d", even, inner=(3, 2, 2, 2, 2), generic=True),
        Case("4d-one-empty", one_empty, inner=(4, 3, 3)),
        Case("all-empty", [0] * w, inner=(4, 3, 3)),
        Case("momentum-none", uneven, inner=(4, 3, 3), kwargs={"momentum": None}, steps=3),
        Case("affine-false", uneven, inner=(4, 3, 3), kwargs={"affine": False}),
        Case("no-running-stats", uneven, inner=(4, 3, 3), kwargs={"track_running_stats": False}),
        Case("float32", uneven, inner=(8, 6, 6), dtype=torch.float32),
        Case("float16-input", uneven, inner=(8, 6, 6), dtype=torch.float16),
        Case("bfloat16-input", uneven, inner=(8, 6, 6), dtype=torch.bfloat16),
        Case("float32-mean1000-4d", even, inner=(4, 16, 16), dtype=torch.float32, scale=0.01, shift=10.0),
        Case("float32-mean1000-2d", [64] * w, inner=(4,), dtype=torch.float32, scale=0.01, shift=10.0),
        Case("float64-mean1000", even, inner=(4, 5, 5), scale=0.01, shift=10.0),
        Case("channels-last", uneven, inner=(5, 4, 3), memory_format=torch.channels_last),
        Case("channels-last-3d", uneven, inner=(5, 2, 4, 3), memory_format=torch.channels_last_3d),
        Case(
            "channels-last-float32",
            even,
            inner=(6, 5, 5),
            dtype=torch.float32,
            memory_format=torch.channels_last,
        ),
    ]
    if w == 2:
        # A .half() layer whose channels hold more than 65504 values across the ranks.
        cases.append(
            Case(
                "half-layer-65536-values",
                [2, 2],
                inner=(2, 128, 128),
                dtype=torch.float16,
                layer_dtype=torch.float16,
                steps=1,
            )
        )
    return cases
