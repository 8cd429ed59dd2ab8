"""fuse_batchnorm_activation with a BatchNorm held in several places: fused once, or left alone.

The reference is the unfused model itself (a deep copy), in float64, with a random upstream gradient.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import syncbn

F64 = torch.float64


def _input(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 3, 3, generator=g, dtype=F64) * 2 + 1


def _train_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaf = x.clone().requires_grad_(True)
    y = model(leaf * 1.0)  # (the in-place layers write over their input: not the leaf)
    y.backward(grad)
    assert leaf.grad is not None
    return y.detach(), leaf.grad


def test_a_batchnorm_in_two_pairs_is_fused_once_into_one_layer() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    model = nn.Sequential(
        nn.Conv2d(3, 3, 1), bn, nn.LeakyReLU(0.1), nn.Conv2d(3, 3, 1), bn, nn.LeakyReLU(0.1)
    )
    model = model.double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    weight = bn.weight.detach().clone()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        syncbn.fuse_batchnorm_activation(model)
    assert isinstance(model[1], syncbn.InPlaceSyncBatchNorm2d) and model[4] is model[1]
    assert isinstance(model[2], nn.Identity) and isinstance(model[5], nn.Identity)
    assert model[1].weight is bn.weight
    torch.testing.assert_close(model[1].weight.detach(), weight - bn.eps, rtol=0, atol=0)  # once
    assert list(model.state_dict()) == list(reference.state_dict())

    x, grad = _input(1), torch.randn(4, 3, 3, 3, dtype=F64)
    # training: output, input gradient, weight/bias gradients and running statistics of the original
    y, dx = _train_step(model, x, grad)
    y_ref, dx_ref = _train_step(reference, x, grad)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=1e-12)
    for name in ("weight", "bias"):
        torch.testing.assert_close(
            getattr(model[1], name).grad, getattr(reference[1], name).grad, rtol=0, atol=1e-12
        )
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[1], name), getattr(reference[1], name), rtol=0, atol=1e-14)
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x.clone()), reference(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("where", ["unfused elsewhere", "another activation"])
def test_a_batchnorm_also_used_outside_its_pair_is_left_unfused(where: str) -> None:
    torch.manual_seed(2)
    shared = nn.BatchNorm2d(3)
    alone = nn.BatchNorm2d(3)  # an ordinary pair in the same model: still fused
    other = nn.Sequential(shared) if where == "unfused elsewhere" else nn.Sequential(shared, nn.ELU())
    model = nn.Sequential(nn.Sequential(shared, nn.LeakyReLU(0.1)), other, alone, nn.LeakyReLU(0.2)).double()
    with torch.no_grad():
        for bn in (shared, alone):
            bn.weight.uniform_(0.5, 2.0)
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"left these BatchNorm layers unfused: .*: 0\.0$"):
        syncbn.fuse_batchnorm_activation(model)
    assert model[0][0] is shared and model[1][0] is shared and isinstance(model[0][1], nn.LeakyReLU)
    assert torch.equal(shared.weight, reference[0][0].weight)  # untouched
    assert isinstance(model[2], syncbn.InPlaceSyncBatchNorm2d) and isinstance(model[3], nn.Identity)

    x, grad = _input(3), torch.randn(4, 3, 3, 3, dtype=F64)
    y, dx = _train_step(model, x, grad)
    y_ref, dx_ref = _train_step(reference, x, grad)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(shared.weight.grad, reference[0][0].weight.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["renorm", "frozen"])
def test_renorm_and_frozen_layers_are_left_unfused(kind: str) -> None:
    # Renorm trains with r and d, a frozen layer with its running statistics: an in-place batch
    # norm would compute something else.
    torch.manual_seed(3)
    if kind == "renorm":
        layer: nn.Module = syncbn.SyncBatchRenorm2d(3, r_max=1.5, d_max=0.5)
    else:
        layer = syncbn.SyncBatchNorm2d(3, freeze=True)
    model = nn.Sequential(layer, nn.LeakyReLU(0.1), nn.BatchNorm2d(3), nn.ELU()).double()
    with torch.no_grad():
        layer.running_mean.fill_(3.0)  # renorm: r and d clip, so it differs from batch norm here
        layer.running_var.fill_(0.1)
        model[2].weight.uniform_(0.5, 2.0)
    reference = copy.deepcopy(model)
    syncbn.fuse_batchnorm_activation(model)
    assert model[0] is layer and isinstance(model[1], nn.LeakyReLU)
    assert isinstance(model[2], syncbn.InPlaceSyncBatchNorm2d) and isinstance(model[3], nn.Identity)
    x, grad = _input(4), torch.randn(4, 3, 3, 3, dtype=F64)
    for got, want in zip(_train_step(model, x, grad), _train_step(reference, x, grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.running_mean, reference[0].running_mean, rtol=0, atol=0)
