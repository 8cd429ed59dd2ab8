"""Masked batch norm (``mask=``): statistics over valid positions only, exact against nn.BatchNorm.

The reference is ``nn.BatchNorm1d`` in float64 applied to the concatenation of the
valid positions (of every rank's batch, in the multi-process case), with random
upstream gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import syncbn
from _helpers.dist_harness import launch
from syncbn.functional import sync_batch_norm

F64 = torch.float64


def _valid(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid positions of an ``(N, C, *)`` tensor as ``(M, C)``."""
    return t.movedim(1, -1)[mask]


def _amax(t: torch.Tensor) -> float:
    """Largest absolute value (0 for an empty tensor)."""
    return float(t.abs().max()) if t.numel() else 0.0


def _lengths_mask(n: int, length: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize(
    "cls, shape, mask_fn",
    [
        (syncbn.SyncBatchNorm1d, (4, 3, 9), lambda: _lengths_mask(4, 9, [9, 4, 1, 6])),
        (syncbn.SyncBatchNorm1d, (7, 3), lambda: torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)),
        (
            syncbn.SyncBatchNorm2d,
            (3, 3, 4, 5),
            lambda: torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(3)) > 0.4,
        ),
        (
            syncbn.SyncBatchNorm,
            (2, 3, 3, 2, 2),
            lambda: torch.rand(2, 3, 2, 2, generator=torch.Generator().manual_seed(4)) > 0.3,
        ),
    ],
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_masked_layer_equals_batchnorm_on_the_valid_positions(
    cls: Any, shape: Any, mask_fn: Any, momentum: Any
) -> None:
    torch.manual_seed(0)
    mask = mask_fn()
    x = (torch.randn(*shape, dtype=F64) * 3 + 5).requires_grad_()
    up = torch.randn(*shape, dtype=F64)
    layer = cls(3, momentum=momentum).double()
    ref = nn.BatchNorm1d(3, momentum=momentum).double()
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(torch.tensor([0.5, -1.5, 2.0]))
            m.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    for _ in range(2):  # twice: the running statistics' update too
        x.grad = None
        y = layer(x, mask=mask)
        (y * up).sum().backward()
        xv = _valid(x.detach(), mask).requires_grad_()
        yv = ref(xv)
        (yv * _valid(up, mask)).sum().backward()
        assert y.shape == x.shape
        torch.testing.assert_close(_valid(y, mask), yv, rtol=0, atol=1e-13)
        assert torch.equal(_valid(y, ~mask), torch.zeros_like(_valid(y, ~mask)))  # padded output: 0
        torch.testing.assert_close(_valid(x.grad, mask), xv.grad, rtol=0, atol=1e-13)
        assert torch.equal(_valid(x.grad, ~mask), torch.zeros_like(_valid(x.grad, ~mask)))  # no gradient
    torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=1e-13)
    torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=1e-13)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=1e-12)
    assert layer.num_batches_tracked == ref.num_batches_tracked == 2
    # eval: the running statistics on the valid positions, 0 elsewhere
    layer.eval()
    ref.eval()
    y = layer(x, mask=mask)
    torch.testing.assert_close(_valid(y, mask), ref(_valid(x, mask)), rtol=0, atol=1e-13)
    assert not _valid(y, ~mask).any()


def test_functional_mask_and_memory_format() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 3, 5, 6, dtype=F64).contiguous(memory_format=torch.channels_last)
    mask = torch.rand(4, 5, 6) > 0.5
    rm, rv = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    y = sync_batch_norm(x, rm, rv, training=True, mask=mask)
    assert y.is_contiguous(memory_format=torch.channels_last)
    v = _valid(x, mask)
    torch.testing.assert_close(_valid(y, mask), (v - v.mean(0)) / (v.var(0, unbiased=False) + 1e-5).sqrt())
    torch.testing.assert_close(rv, 0.9 + 0.1 * v.var(0))


def test_frozen_layer_with_mask_uses_running_stats() -> None:
    layer = syncbn.SyncBatchNorm1d(2, freeze=True).double()
    with torch.no_grad():
        layer.running_mean.fill_(1.0)
        layer.running_var.fill_(4.0)
    x = torch.randn(3, 2, 4, dtype=F64)
    mask = _lengths_mask(3, 4, [4, 2, 0])
    y = layer(x, mask=mask)
    torch.testing.assert_close(_valid(y, mask), (_valid(x, mask) - 1.0) / (4.0 + 1e-5) ** 0.5)
    assert not _valid(y, ~mask).any()


def test_bad_masks_raise_before_any_state_changes() -> None:
    layer = syncbn.SyncBatchNorm1d(3)
    x = torch.randn(2, 3, 5)
    cases = [
        (torch.ones(2, 5), TypeError, r"boolean mask.*got dtype torch.float32"),
        (torch.ones(2, 4, dtype=torch.bool), ValueError, r"mask of shape \[2, 5\].*got mask size \[2, 4\]"),
        (torch.ones(2, 3, 5, dtype=torch.bool), ValueError, r"mask of shape \[2, 5\]"),
        ([[True] * 5] * 2, TypeError, r"torch.Tensor or None \(got list\)"),
    ]
    for mask, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            layer(x, mask=mask)
    assert layer.num_batches_tracked == 0 and torch.equal(layer.running_mean, torch.zeros(3))
    with pytest.raises(ValueError, match=r"expected 2D or 3D input \(got 4D input\)"):
        layer(torch.randn(2, 3, 4, 4), mask=torch.ones(2, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(
            x,
            mask=torch.zeros(2, 5, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True)[:1].expand(2, 5)
            & torch.tensor([[True], [False]]),
        )


def _masked_ranks(rank: int, world_size: int) -> dict[str, float]:
    """Each rank: its own batch size and valid lengths (rank 1: a batch with no valid position in case 2)."""
    out: dict[str, float] = {}
    cases = {
        "uneven": ([[9, 3, 7], [2, 8]], 9),
        "empty_rank": ([[5, 1, 6], [0, 0]], 6),
    }
    for name, (all_lengths, length) in cases.items():
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(len(ls), 4, length, generator=g, dtype=F64) * 2 + 3 for ls in all_lengths]
        ups = [torch.randn(len(ls), 4, length, generator=g, dtype=F64) for ls in all_lengths]
        masks = [_lengths_mask(len(ls), length, ls) for ls in all_lengths]
        layer = syncbn.SyncBatchNorm1d(4).double()
        ref = nn.BatchNorm1d(4).double()
        x = xs[rank].clone().requires_grad_()
        y = layer(x, mask=masks[rank])
        (y * ups[rank]).sum().backward()
        xv = torch.cat([_valid(t, m) for t, m in zip(xs, masks)]).requires_grad_()
        yv = ref(xv)
        (yv * torch.cat([_valid(u, m) for u, m in zip(ups, masks)])).sum().backward()
        start = sum(int(m.sum()) for m in masks[:rank])
        mine = slice(start, start + int(masks[rank].sum()))
        out[f"{name}.out"] = _amax(_valid(y, masks[rank]) - yv[mine])
        out[f"{name}.grad"] = _amax(_valid(x.grad, masks[rank]) - xv.grad[mine])
        out[f"{name}.padded"] = _amax(_valid(x.grad, ~masks[rank])) + _amax(_valid(y, ~masks[rank]))
        wgrad = layer.weight.grad.clone()
        dist.all_reduce(wgrad)
        out[f"{name}.wgrad"] = float((wgrad - ref.weight.grad).abs().max())
        out[f"{name}.running_var"] = float((layer.running_var - ref.running_var).abs().max())
        out[f"{name}.running_mean"] = float((layer.running_mean - ref.running_mean).abs().max())
    return out


def test_masked_across_ranks_equals_batchnorm_on_all_valid_positions() -> None:
    for result in launch(_masked_ranks, 2):
        for key, err in result.items():
            assert err < 1e-12, (key, err)
