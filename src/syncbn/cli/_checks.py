"""Equivalence checks, ``verify``'s and the test suite's: syncbn on W ranks vs float64 ``nn.BatchNorm``. Every
rank of the group runs the same cases in the same order (each runs collectives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d

__all__ = ["Case", "run_case", "tolerance", "standard_cases", "EXACT_KEYS"]

_REF = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
_OURS = {2: SyncBatchNorm1d, 3: SyncBatchNorm1d, 4: SyncBatchNorm2d, 5: SyncBatchNorm3d}

#: Error keys that must be exactly zero (flags and counters, not rounding errors).
EXACT_KEYS = ("nan", "num_batches_tracked")


@dataclass
class Case:
    """One equivalence scenario.

    ``sizes``: per-rank batch sizes, one per rank of the group (0: an empty rank); ``inner``:
    ``(C, *spatial)``; ``layer_dtype``: float32 for low-precision input unless given;
    ``scale``, ``shift``: the input's standard deviation and mean; ``steps``: training steps
    compared; ``generic``: :class:`syncbn.SyncBatchNorm` instead of the 1d/2d/3d class.
    """

    name: str
    sizes: list[int]
    inner: tuple[int, ...] = (4, 5)
    dtype: torch.dtype = torch.float64
    layer_dtype: torch.dtype | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    shift: float = 0.0
    memory_format: torch.memory_format | None = None
    steps: int = 2
    generic: bool = False
    seed: int = 0


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def run_case(
    case: Case,
    rank: int,
    group: Any = None,
    group_rank: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Run ``case`` on this rank; return the largest error per key against the reference.

    The shard is ``case.sizes[group_rank]`` (``group_rank`` defaults to ``rank``); syncbn runs on ``device``
    over ``group``, the reference in float64 on the CPU. Keys: ``output``, ``grad_input``, ``grad_weight``,
    ``grad_bias``, ``running_mean``, ``running_var`` (those that apply), ``nan`` (1.0 when an output or
    gradient was not finite) and ``num_batches_tracked`` (the counter's difference). Raises ``AssertionError``
    when the output has the wrong dtype, shape or memory format, or there is no input gradient.
    """
    device = torch.device(device)
    group_rank = rank if group_rank is None else group_rank
    gen = torch.Generator().manual_seed(case.seed)
    channels = case.inner[0]
    total = sum(case.sizes)
    start = sum(case.sizes[:group_rank])
    stop = start + case.sizes[group_rank]

    ndim = 1 + len(case.inner)
    ref = _REF.get(ndim, nn.BatchNorm1d)(channels, **case.kwargs).double()
    cls = SyncBatchNorm if case.generic else _OURS[ndim]
    low_precision = case.dtype in (torch.float16, torch.bfloat16)
    layer_dtype = case.layer_dtype or (torch.float32 if low_precision else case.dtype)
    ours = cls(channels, process_group=group, **case.kwargs).to(device=device, dtype=layer_dtype)
    with torch.no_grad():  # the same kwargs: both layers have weights, and running stats, or neither
        initial: dict[str, torch.Tensor] = {}
        if ref.affine:
            initial["weight"] = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
            initial["bias"] = torch.randn(channels, generator=gen, dtype=torch.float64)
        if ref.track_running_stats:
            initial["running_mean"] = torch.randn(channels, generator=gen, dtype=torch.float64)
            initial["running_var"] = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
        for layer in (ref, ours):
            for key, value in initial.items():
                getattr(layer, key).copy_(value)

    errors: dict[str, float] = {}

    def note(key: str, value: float) -> None:
        errors[key] = max(errors.get(key, 0.0), value)

    def shard(batch: torch.Tensor) -> torch.Tensor:
        t = batch[start:stop].to(device=device, dtype=case.dtype)
        return t if case.memory_format is None else t.contiguous(memory_format=case.memory_format)

    for _ in range(case.steps):
        full = torch.randn(total, *case.inner, generator=gen, dtype=torch.float64) * case.scale + case.shift
        full = full.to(case.dtype).double()  # the reference sees exactly the values we feed
        grad = torch.randn(total, *case.inner, generator=gen, dtype=torch.float64)

        ref.zero_grad()
        ours.zero_grad()
        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref.flatten(2)).view_as(x_ref) if ndim > 5 else ref(x_ref)
        y_ref.backward(grad)
        assert x_ref.grad is not None

        x = shard(full).requires_grad_()
        y = ours(x)
        y.backward(shard(grad))

        _expect(y.dtype == case.dtype, f"output dtype {y.dtype}, expected {case.dtype}")
        _expect(y.shape == x.shape, f"output shape {tuple(y.shape)}, expected {tuple(x.shape)}")
        if case.memory_format is not None and x.numel() > 0:
            _expect(y.is_contiguous(memory_format=case.memory_format), "output lost its memory format")
        _expect(x.grad is not None, "no input gradient")
        assert x.grad is not None
        out_scale = y_ref.detach().abs().max().clamp(min=1).item() if total else 1.0
        if x.numel():
            note("output", (y.detach().double().cpu() - y_ref[start:stop]).abs().max().item() / out_scale)
            gscale = x_ref.grad.abs().max().clamp(min=1e-12).item()
            note("grad_input", (x.grad.double().cpu() - x_ref.grad[start:stop]).abs().max().item() / gscale)
        note("nan", float(not bool(torch.isfinite(y).all() and torch.isfinite(x.grad).all())))
        if ours.weight is not None and ours.bias is not None and ref.weight is not None:
            assert ref.weight.grad is not None and ref.bias.grad is not None
            wscale = max(ref.weight.grad.abs().max().item(), ref.bias.grad.abs().max().item(), 1.0)
            have_grads = ours.weight.grad is not None and ours.bias.grad is not None
            for key in ("weight", "bias"):
                summed = torch.zeros(channels, dtype=torch.float64, device=device)
                if have_grads:
                    summed += getattr(ours, key).grad.detach().double()
                dist.all_reduce(summed, group=group)
                note(f"grad_{key}", (summed.cpu() - getattr(ref, key).grad).abs().max().item() / wscale)
        if ref.running_mean is not None and ref.running_var is not None:
            for key in ("running_mean", "running_var"):
                note(key, (getattr(ours, key).double().cpu() - getattr(ref, key)).abs().max().item())
            assert ours.num_batches_tracked is not None and ref.num_batches_tracked is not None
            tracked = int(ours.num_batches_tracked) - int(ref.num_batches_tracked)
            note("num_batches_tracked", float(abs(tracked)))
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
    f32, f16 = torch.float32, torch.float16
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
        Case("float32", uneven, inner=(8, 6, 6), dtype=f32),
        Case("float16-input", uneven, inner=(8, 6, 6), dtype=f16),
        Case("bfloat16-input", uneven, inner=(8, 6, 6), dtype=torch.bfloat16),
        Case("float32-mean1000-4d", even, inner=(4, 16, 16), dtype=f32, scale=0.01, shift=10.0),
        Case("float32-mean1000-2d", [64] * w, inner=(4,), dtype=f32, scale=0.01, shift=10.0),
        Case("float64-mean1000", even, inner=(4, 5, 5), scale=0.01, shift=10.0),
        Case("channels-last", uneven, inner=(5, 4, 3), memory_format=torch.channels_last),
        Case("channels-last-3d", uneven, inner=(5, 2, 4, 3), memory_format=torch.channels_last_3d),
        Case("channels-last-float32", even, inner=(6, 5, 5), dtype=f32, memory_format=torch.channels_last),
    ]
    if w == 2:  # a .half() layer whose channels hold more than 65504 values across the ranks
        cases.append(Case("half-layer-65536-values", [2, 2], (2, 128, 128), f16, layer_dtype=f16, steps=1))
    return cases
