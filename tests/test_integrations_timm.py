"""timm models with syncbn: conversion (BatchNormAct2d included), exact DDP training, timm's utilities.

Also torchvision code that recognises BatchNorm layers by type (MViT's block).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import syncbn
from _helpers import torchvision_shim  # noqa: F401  (before timm imports torchvision)
from _helpers.dist_harness import launch

timm = pytest.importorskip("timm")
from timm.layers import BatchNormAct2d, FrozenBatchNormAct2d, freeze_batch_norm_2d  # noqa: E402
from timm.utils import distribute_bn  # noqa: E402

from syncbn.integrations.timm import SyncBatchNormAct2d  # noqa: E402

# name -> number of BatchNorm layers (the counts)
MODELS = {
    "resnet18": 20,
    "efficientnet_b0": 49,
    "mobilenetv3_small_100": 34,
    "regnetx_002": 44,
    "densenet121": 121,
}


def _bn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("name", [*MODELS, "repghostnet_050", "efficientvit_b0"])
def test_timm_models_convert_every_layer_and_revert_to_the_same_types(name: str) -> None:
    model = timm.create_model(name, pretrained=False)
    before = [(n, type(m)) for n, m in model.named_modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConversionWarning: every BatchNorm layer converts
        conv = syncbn.convert_sync_batchnorm(model)
    layers = _bn_layers(conv)
    assert layers and all(isinstance(m, syncbn.SyncBatchNorm) for m in layers)
    if name in MODELS:
        assert len(layers) == MODELS[name]
    for m in layers:
        if isinstance(m, SyncBatchNormAct2d):  # drop/act kept, and still a timm BatchNormAct2d
            assert isinstance(m, BatchNormAct2d) and hasattr(m, "act") and hasattr(m, "drop")
    assert list(conv.state_dict()) == list(state)
    back = syncbn.revert_sync_batchnorm(conv)
    assert [(n, type(m)) for n, m in back.named_modules()] == before
    assert all(torch.equal(v, state[k]) for k, v in back.state_dict().items())


def test_batchnormact_conversion_keeps_act_and_drop_and_computes_the_same() -> None:
    torch.manual_seed(0)
    layer = BatchNormAct2d(5, act_layer=nn.SiLU, drop_layer=nn.Dropout).double()
    act, drop = layer.act, layer.drop
    ref = copy.deepcopy(layer)
    conv = syncbn.convert_sync_batchnorm(layer)
    assert type(conv) is SyncBatchNormAct2d and conv.act is act and conv.drop is drop
    drop.p = 0.0
    ref.drop.p = 0.0
    x = torch.randn(4, 5, 3, 3, dtype=torch.float64) + 2
    assert torch.equal(conv(x), ref(x))  # single process: exactly timm's layer
    assert torch.equal(conv.running_var, ref.running_var)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        conv(torch.randn(2, 5, 3, dtype=torch.float64))
    # masked: the activation runs once, after the masked batch norm
    mask = torch.rand(4, 3, 3, generator=torch.Generator().manual_seed(2)) > 0.4
    plain = syncbn.SyncBatchNorm2d(5).double()
    plain.load_state_dict(conv.state_dict())
    assert torch.equal(conv(x, mask=mask), nn.functional.silu(plain(x, mask=mask)))
    # timm's own synchronised class (its converter's output) converts too, and reverts to BatchNormAct2d
    timm_sync = timm.layers.convert_sync_batchnorm(nn.Sequential(BatchNormAct2d(5)))
    assert type(timm_sync[0]).__name__ == "SyncBatchNormAct"
    ours = syncbn.convert_sync_batchnorm(timm_sync)
    assert type(ours[0]) is SyncBatchNormAct2d
    assert type(syncbn.revert_sync_batchnorm(ours)[0]) is BatchNormAct2d


def test_timm_freeze_batch_norm_2d_finds_syncbn_layers() -> None:
    resnet = syncbn.convert_sync_batchnorm(timm.create_model("resnet18", pretrained=False))
    frozen = freeze_batch_norm_2d(resnet)
    assert sum(type(m).__name__ == "FrozenBatchNorm2d" for m in frozen.modules()) == 20
    assert not any(isinstance(m, syncbn.SyncBatchNorm) for m in frozen.modules())
    effnet = syncbn.convert_sync_batchnorm(timm.create_model("efficientnet_b0", pretrained=False))
    frozen = freeze_batch_norm_2d(effnet)
    assert sum(isinstance(m, FrozenBatchNormAct2d) for m in frozen.modules()) == 49
    assert not any(isinstance(m, syncbn.SyncBatchNorm) for m in frozen.modules())


def test_torchvision_mvit_block_recognises_syncbn_1d_as_batchnorm1d() -> None:
    # MViT's block transposes (N, L, C) tokens for a norm layer that is an nn.BatchNorm1d.
    from torchvision.models.video.mvit import MSBlockConfig, MultiscaleBlock

    cnf = MSBlockConfig(
        num_heads=2,
        input_channels=8,
        output_channels=8,
        kernel_q=[1, 1, 1],  # no pooling (its norms see 4D input)
        kernel_kv=[1, 1, 1],
        stride_q=[1, 1, 1],
        stride_kv=[1, 1, 1],
    )

    def block(norm: Any) -> nn.Module:
        torch.manual_seed(0)
        return MultiscaleBlock([2, 3, 3], cnf, True, True, True, True, norm_layer=norm).double()

    ours, ref = block(syncbn.SyncBatchNorm1d), block(nn.BatchNorm1d)
    assert ours.needs_transposal
    x = torch.randn(4, 1 + 2 * 3 * 3, 8, dtype=torch.float64)
    assert torch.allclose(ours(x, (2, 3, 3))[0], ref(x, (2, 3, 3))[0], rtol=0, atol=1e-12)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest value (at least 1e-3: some stay near 0)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def _ddp_models(rank: int, world_size: int) -> dict[str, Any]:
    """Each timm model under DDP on a shard of the global batch vs one process on all of it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict[str, Any] = {}
    per_rank = 4
    for name in MODELS:
        torch.manual_seed(0)
        ref = timm.create_model(name, pretrained=False, num_classes=3).double()
        model = copy.deepcopy(ref)
        types = [type(m) for m in model.modules()]
        ddp = DDP(syncbn.convert_sync_batchnorm(model))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        errors: dict[str, float] = {}
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        for step in range(2):
            x = torch.randn(per_rank * world_size, 3, 32, 32, generator=g, dtype=torch.float64) + 1.0
            up = torch.randn(per_rank * world_size, 3, generator=g, dtype=torch.float64)
            opt.zero_grad()
            ref_opt.zero_grad()
            out = ddp(x[rows])
            (out * up[rows]).sum().backward()
            ref_out = ref(x)
            ((ref_out * up).sum() / world_size).backward()  # DDP averages the ranks' gradients
            errors[f"out{step}"] = _rel(out, ref_out[rows])
            # relative to the largest gradient (some are 0 up to rounding: a bias followed by a norm)
            scale = max(float(q.grad.abs().max()) for q in ref.parameters())
            errors[f"grad{step}"] = max(
                float((p.grad - q.grad).abs().max()) / scale
                for p, q in zip(model.parameters(), ref.parameters())
            )
            opt.step()
            ref_opt.step()
        ref_state = ref.state_dict()
        errors["state"] = max(
            _rel(v, ref_state[k]) for k, v in model.state_dict().items() if v.is_floating_point()
        )
        # timm's distribute_bn on a syncbn model: the buffers are already equal, so no change.
        before = {k: v.clone() for k, v in model.state_dict().items()}
        distribute_bn(model, world_size, reduce=True)
        distribute_bn(model, world_size, reduce=False)
        errors["distribute_bn"] = max(
            _rel(v, before[k]) for k, v in model.state_dict().items() if "running" in k
        )
        back = syncbn.revert_sync_batchnorm(model)
        results[name] = {"errors": errors, "same_types": [type(m) for m in back.modules()] == types}
    return results


@pytest.mark.timeout(600)
def test_timm_models_under_ddp_equal_the_full_batch_reference() -> None:
    results = launch(_ddp_models, 2, timeout=480)
    for rank_result in results:
        for name, result in rank_result.items():
            assert result["same_types"], name
            for key, err in result["errors"].items():
                assert err < 1e-9, (name, key, err)
