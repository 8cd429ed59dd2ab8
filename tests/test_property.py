"""Exactness as a property: syncbn is as close to the truth as nn.BatchNorm is, in every dtype.

Hypothesis draws the cases: input rank (2D-5D), channels, the per-rank split
(uneven, with empty ranks), the dtypes (float16, bfloat16 or float32 input to a
float32 layer; float64 throughout), affine and running-statistics options, the
data's offset (|mean|/std from 1 to 1e3) and scale, channels-last memory
format, and the upstream gradient's offset (a mean of up to 2 standard
deviations, which makes the two terms of the input gradient cancel). For each case the truth
is a float64 ``nn.BatchNorm`` on the global batch (the very same input values,
widened), and the property is, for the output, the input gradient, the
weight/bias gradients (summed over ranks) and the running statistics::

    error(syncbn) <= FACTOR * error(nn.BatchNorm in the same dtypes) + floor

with ``FACTOR = 1.5`` and ``floor = FLOOR_ULPS * (eps * kappa + 2.2e-16 * kappa**2)
* scale`` (``FLOOR_ULPS = 16``), where ``eps`` is the machine epsilon of the
layer's dtype (float32 or float64: never the input's 16-bit epsilon, so
rounding a 16-bit result twice fails), ``kappa`` is 1 + the largest
|mean| / sqrt(var + 1e-5) over channels (the conditioning every float batch norm pays for:
statistics handed to the kernels in the layer's dtype), the ``kappa**2`` term
is the float64 merge of the ranks' moments (``Q/N - mean^2``, which matters for
float64 layers only), and ``scale`` is the magnitude the quantity's rounding
errors scale with (see :func:`_scales`). The floor covers the cases where
nn.BatchNorm is exact by luck (its error is then zero). ``num_batches_tracked``
must be equal.

The same property runs in one process through the thread driver
(:func:`syncbn.parallel.data_parallel`, chunk sizes from the case) with
Hypothesis shrinking any failure, there again with the accelerator flow (what
a CUDA tensor takes, switched on for CPU tensors), and over two real gloo ranks (one launch for
a fixed, derandomised list of drawn cases). Runtime is bounded: fixed example
counts, no deadline per example, no example database, derandomised.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import syncbn  # noqa: E402
from _helpers.dist_harness import launch  # noqa: E402
from syncbn.engine import _function, _math  # noqa: E402
from syncbn.parallel import data_parallel  # noqa: E402

FACTOR = 1.5
FLOOR_ULPS = 16.0
# The float64 merge of the ranks' moments, var = Q/N - mean^2, loses about
# 1e-16 * kappa^2 of the variance (see syncbn.engine._math): part of the floor.
MERGE_EPS = torch.finfo(torch.float64).eps

# (input dtype, layer dtype): the combinations nn.BatchNorm itself runs on CPU.
DTYPES = [
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
]

QUANTITIES = ("output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var")


@dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]  # per-rank batch sizes
    channels: int
    inner: tuple[int, ...]  # the dimensions after the channels
    dtype: torch.dtype
    layer_dtype: torch.dtype
    affine: bool
    track: bool
    offset: float  # |mean| / std of each channel
    std: float
    grad_offset: float  # mean of the upstream gradient (its std is 1)
    channels_last: bool  # 4D/5D input in channels-last memory format
    seed: int


@st.composite
def cases(draw: Any, max_ranks: int = 4) -> Case:
    dims = draw(st.integers(2, 5))
    ranks = draw(st.integers(2, max_ranks))
    inner = tuple(draw(st.lists(st.integers(1, 4), min_size=dims - 2, max_size=dims - 2)))
    per_sample = math.prod(inner)
    sizes = draw(
        st.lists(st.integers(0, 5), min_size=ranks, max_size=ranks).filter(lambda s: sum(s) * per_sample >= 2)
    )
    dtype, layer_dtype = draw(st.sampled_from(DTYPES))
    return Case(
        sizes=tuple(sizes),
        channels=draw(st.integers(1, 4)),
        inner=inner,
        dtype=dtype,
        layer_dtype=layer_dtype,
        affine=draw(st.booleans()),
        track=draw(st.booleans()),
        offset=10.0 ** draw(st.floats(0.0, 3.0)),
        std=10.0 ** draw(st.floats(-1.0, 1.0)),
        grad_offset=draw(st.floats(-2.0, 2.0)),
        channels_last=dims >= 4 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _data(case: Case) -> dict[str, Tensor]:
    """The global batch, upstream gradient and layer state of a case (the same on every rank)."""
    gen = torch.Generator().manual_seed(case.seed)
    c = case.channels
    shape = (sum(case.sizes), c, *case.inner)
    signs = torch.randint(0, 2, (c,), generator=gen, dtype=torch.float64) * 2 - 1
    centre = (signs * case.offset * case.std).view(1, c, *([1] * len(case.inner)))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * case.std + centre).to(case.dtype)
    g = (torch.randn(shape, generator=gen, dtype=torch.float64) + case.grad_offset).to(case.dtype)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    state = {
        "weight": torch.rand(c, generator=gen, dtype=torch.float64) + 0.5,
        "bias": torch.randn(c, generator=gen, dtype=torch.float64),
        "running_mean": torch.randn(c, generator=gen, dtype=torch.float64),
        "running_var": torch.rand(c, generator=gen, dtype=torch.float64) + 0.5,
    }
    return {"x": x, "g": g, **state}


def _layer(cls: type[nn.Module], case: Case, data: dict[str, Tensor], dtype: torch.dtype) -> nn.Module:
    layer = cls(case.channels, affine=case.affine, track_running_stats=case.track).to(dtype)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            tensor = getattr(layer, name)
            if tensor is not None:
                tensor.copy_(data[name])
    return layer


def _plain_class(case: Case) -> type[nn.Module]:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(case.inner) + 2]


def _step(layer: nn.Module, x: Tensor, g: Tensor, run: Any = None) -> dict[str, Tensor | None]:
    """One training forward and backward; what the property compares."""
    x = x.clone().requires_grad_()
    y = layer(x) if run is None else run(layer, x)
    y.backward(g)
    return {
        "output": y.detach(),
        "grad_input": x.grad,
        "grad_weight": None if layer.weight is None else layer.weight.grad,
        "grad_bias": None if layer.bias is None else layer.bias.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
        "num_batches_tracked": layer.num_batches_tracked,
    }


def references(case: Case, data: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(truth, nn)``: float64 nn.BatchNorm and nn.BatchNorm in the case's dtypes, on the global batch."""
    cls = _plain_class(case)
    truth = _step(_layer(cls, case, data, torch.float64), data["x"].double(), data["g"].double())
    plain = _step(_layer(cls, case, data, case.layer_dtype), data["x"], data["g"])
    return truth, plain


def check(
    case: Case, data: dict[str, Tensor], truth: dict[str, Any], plain: dict[str, Any], ours: dict[str, Any]
) -> list[str]:
    """The property, quantity by quantity; the list of violations (empty when it holds)."""
    eps = torch.finfo(case.layer_dtype).eps
    scales, kappa = _scales(case, data, truth)
    problems = []
    for key in QUANTITIES:
        want, theirs, got = truth[key], plain[key], ours[key]
        if want is None:
            if got is not None:
                problems.append(f"{key}: expected none, got one")
            continue
        if got is None or got.shape != want.shape or got.dtype != theirs.dtype:
            problems.append(f"{key}: expected {tuple(want.shape)} {theirs.dtype}, got {got!r:.60}")
            continue
        if want.numel() == 0:
            continue
        ours_err = (got.double() - want).abs().max().item()
        nn_err = (theirs.double() - want).abs().max().item()
        floor = FLOOR_ULPS * (eps * kappa + MERGE_EPS * kappa**2) * scales[key]
        if not ours_err <= FACTOR * nn_err + floor:  # also catches NaN
            problems.append(
                f"{key}: syncbn error {ours_err:.3e} > {FACTOR} x nn.BatchNorm's {nn_err:.3e} + {floor:.3e}"
            )
    if case.track and not torch.equal(ours["num_batches_tracked"], truth["num_batches_tracked"]):
        problems.append("num_batches_tracked differs")
    return problems


def _scales(case: Case, data: dict[str, Tensor], truth: dict[str, Any]) -> tuple[dict[str, float], float]:
    """Per quantity, the magnitude its rounding errors scale with; and the conditioning ``kappa``.

    A float batch norm hands its statistics to the kernels in the layer's
    dtype: the mean's rounding, ``eps * |mean|``, moves ``xhat`` by
    ``eps * |mean| / std``. The output moves with ``xhat`` times ``w`` (the
    inference kernels evaluate ``x * alpha + beta``, whose two terms cancel to
    that precision even where the output is zero); the input gradient
    is a difference of terms of size ``w * invstd * |g|`` (which cancel to far
    less when the batch is small); the weight gradient a sum of ``|g|``.
    """
    x, g = data["x"].double(), data["g"].double()
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x, dims, correction=0)
    kappa = 1.0 + (mean.abs() * (var + 1e-5).rsqrt()).max().item()
    weight = data["weight"].abs().max().item() if case.affine else 1.0
    invstd = (var + 1e-5).rsqrt().max().item()
    g_sums = g.abs().sum(dims).max().item() if g.numel() else 0.0
    biggest = {
        k: 0.0 if truth[k] is None or truth[k].numel() == 0 else truth[k].abs().max().item()
        for k in QUANTITIES
    }
    scales = dict(biggest)
    scales["output"] = max(biggest["output"], weight)
    scales["grad_input"] = max(biggest["grad_input"], weight * invstd * g.abs().max().item())
    scales["grad_weight"] = max(biggest["grad_weight"], g_sums)
    scales["grad_bias"] = max(biggest["grad_bias"], g_sums)
    return scales, kappa


def run_threads(case: Case) -> list[str]:
    """The property in one process: the thread driver with the case's chunk sizes."""
    data = _data(case)
    truth, plain = references(case, data)
    layer = _layer(syncbn.SyncBatchNorm, case, data, case.layer_dtype)
    ours = _step(layer, data["x"], data["g"], lambda m, x: data_parallel(m, x, chunks=list(case.sizes)))
    return check(case, data, truth, plain, ours)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
def test_thread_driver_is_as_exact_as_batchnorm(case: Case) -> None:
    problems = run_threads(case)
    assert not problems, f"{case}: " + "; ".join(problems)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
def test_accelerator_flow_is_as_exact_as_batchnorm(case: Case) -> None:
    # The flow a CUDA tensor takes (no host reads, the count as a device tensor, the
    # low-precision input gradient in three whole-batch kernels), run on CPU.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_function, "_host_side", lambda x: False)
        whole_batch = functools.partial(_math._low_precision_input_grad, blocked=False)
        patch.setattr(_math, "_low_precision_input_grad", whole_batch)
        problems = run_threads(case)
    assert not problems, f"{case}: " + "; ".join(problems)


# ---------------------------------------------------------------- over real gloo ranks

GLOO_EXAMPLES = 80


def _drawn_cases(count: int) -> list[Case]:
    """A fixed list of ``count`` cases drawn by Hypothesis (derandomised: the same on every run)."""
    drawn: list[Case] = []

    @settings(
        max_examples=count, deadline=None, derandomize=True, database=None, phases=[hypothesis.Phase.generate]
    )
    @given(case=cases(max_ranks=2).filter(lambda c: len(c.sizes) == 2))
    def collect(case: Case) -> None:
        if len(drawn) < count:
            drawn.append(case)

    collect()
    return drawn


def _rank_results(rank: int, world_size: int, drawn: list[Case]) -> list[Any]:
    """This rank's share of every drawn case: its shard through syncbn on the process group."""
    out: list[Any] = []
    for case in drawn:
        data = _data(case)
        start, stop = sum(case.sizes[:rank]), sum(case.sizes[: rank + 1])
        layer = _layer(syncbn.SyncBatchNorm, case, data, case.layer_dtype)
        try:
            out.append(_step(layer, data["x"][start:stop], data["g"][start:stop]))
        except Exception as exc:  # noqa: BLE001 - reported per case
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_gloo_ranks_are_as_exact_as_batchnorm() -> None:
    drawn = _drawn_cases(GLOO_EXAMPLES)
    assert len(drawn) == GLOO_EXAMPLES
    results = launch(_rank_results, 2, drawn, timeout=240)
    failures = []
    for i, case in enumerate(drawn):
        shares = [results[rank][i] for rank in range(2)]
        errors = [f"rank {r}: {s}" for r, s in enumerate(shares) if not isinstance(s, dict)]
        if errors:
            failures.append(f"{case}: " + "; ".join(errors))
            continue
        data = _data(case)
        truth, plain = references(case, data)
        for rank, share in enumerate(shares):
            # Outputs and input gradients are the rank's rows of the global ones; weight/bias
            # gradients are per rank and sum to the global ones; running statistics are global.
            ours = dict(share)
            for key in ("output", "grad_input"):
                ours[key] = torch.cat([s[key] for s in shares])
            for key in ("grad_weight", "grad_bias"):
                if share[key] is not None:
                    ours[key] = sum(s[key] for s in shares)
            problems = check(case, data, truth, plain, ours)
            if problems:
                failures.append(f"rank {rank} {case}: " + "; ".join(problems))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("x_channels_last", [True, False])
def test_bfloat16_backward_sums_with_mixed_memory_formats_are_float32_sums(x_channels_last: bool) -> None:
    # torch's CPU kernel sums a bfloat16 g in bfloat16 when g and x differ in memory format.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 3, 4, 5, generator=gen).bfloat16()
    g = (torch.randn(8, 2, 3, 4, 5, generator=gen) + 0.3).bfloat16()
    if x_channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    else:
        g = g.contiguous(memory_format=torch.channels_last_3d)
    sum_dy, sum_dy_xhat = _math.backward_sums(g, x, None, torch.zeros(2), torch.ones(2), 0.0)
    dims = (0, 2, 3, 4)
    assert sum_dy.dtype == sum_dy_xhat.dtype == torch.float32
    torch.testing.assert_close(sum_dy.double(), g.double().sum(dims), rtol=1e-6, atol=1e-4)
    want = (g.double() * x.double()).sum(dims)
    torch.testing.assert_close(sum_dy_xhat.double(), want, rtol=1e-6, atol=1e-4)
