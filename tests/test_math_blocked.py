"""The block-by-block centred reduction used for large contiguous inputs is exact."""

from __future__ import annotations

import pytest
import torch

from syncbn.engine import _math


@pytest.mark.parametrize("shape", [(7, 3, 5, 4), (5, 4, 3, 2, 2), (9, 2, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_blocked_moments_match_full_batch(monkeypatch, shape, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.01 + 10.0).to(dtype)
    dims = [0, *range(2, x.dim())]
    ref_var, ref_mean = torch.var_mean(x.double(), dim=dims, correction=0)
    expected = _math.local_moments(x)
    monkeypatch.setattr(_math, "_NATIVE_STATS_MAX_NUMEL", 0)  # small inputs would take the native kernel
    monkeypatch.setattr(_math, "_BLOCKED_MIN_NUMEL", 1)
    monkeypatch.setattr(_math, "_BLOCK_NUMEL", 2 * x[0].numel())  # blocks of two samples, last one short
    mean, var = _math.local_moments(x)
    assert mean.dtype == var.dtype == _math.accumulation_dtype(dtype)
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(mean.double(), ref_mean, rtol=tol, atol=tol)
    torch.testing.assert_close(var.double(), ref_var, rtol=100 * tol, atol=tol)
    torch.testing.assert_close(var, expected[1], rtol=100 * tol, atol=tol)
