"""Eager quantization of converted models: fuse_modules (eval), fuse_modules_qat + prepare_qat (train).

The QAT models keep their batch norm synchronised: exact on 2 gloo ranks against torch's own QAT
modules on the global batch.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
from torch import nn
from torch.ao.quantization import QConfig, convert, fuse_modules, fuse_modules_qat, prepare_qat

import syncbn
from _helpers.compare import rank_steps_errors
from _helpers.dist_harness import launch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

GROUPS = [["0", "1", "2"], ["3", "4"], ["7", "8"]]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),  # 6x6 -> 4x4
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 2, 1),
        nn.BatchNorm2d(2),
        nn.Flatten(),
        nn.ReLU(),
        nn.Linear(32, 5),
        nn.BatchNorm1d(5),
    ).double()
    for m in model.modules():  # non-trivial running statistics and affine parameters
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


def _no_quantization() -> QConfig:
    # QAT modules without fake quantization: what is left is the fused modules' batch-norm math.
    return QConfig(activation=nn.Identity, weight=nn.Identity)


def test_fuse_modules_in_eval_folds_the_batch_norm() -> None:
    ref = _model().eval()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref)).eval()
    fused = fuse_modules(ours, GROUPS)
    assert type(fused[0]) is nni.ConvReLU2d and type(fused[3]) is nn.Conv2d and type(fused[7]) is nn.Linear
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x), ref(x), rtol=0, atol=1e-12)

    # the generic class (mmengine's "ExactSyncBN") fuses too
    generic = nn.Sequential(nn.Conv2d(3, 4, 1), syncbn.SyncBatchNorm(4), nn.ReLU()).double().eval()
    want = generic(x)
    fused = fuse_modules(generic, [["0", "1", "2"]])
    assert type(fused[0]) is nni.ConvReLU2d
    torch.testing.assert_close(fused(x), want)
    qat = fuse_modules_qat(generic.train(), [["0", "1", "2"]])
    assert type(qat[0]) is syncbn.quantization.ConvSyncBnReLU2d

    pair = nn.Sequential(syncbn.SyncBatchNorm2d(3), nn.ReLU()).eval()
    bn_relu = fuse_modules(pair, [["0", "1"]])[0]
    assert type(bn_relu) is nni.BNReLU2d and type(bn_relu[0]) is nn.BatchNorm2d  # eval: a plain copy
    # in training the plain copy would train unsynchronised: refused, the model unchanged
    for layer in (syncbn.SyncBatchNorm2d(3), syncbn.SyncBatchRenorm3d(3)):
        pair = nn.Sequential(layer, nn.ReLU()).train()
        with pytest.raises(ValueError, match="expected the model in eval, got a SyncBatch"):
            fuse_modules(pair, [["0", "1"]], inplace=True)
        assert pair[0] is layer and type(pair[1]) is nn.ReLU

    for dim in (1, 3):
        conv = getattr(nn, f"ConvTranspose{dim}d")(3, 3, 1)
        bn = getattr(syncbn, f"SyncBatchNorm{dim}d")(3)
        seq = nn.Sequential(conv, bn).eval()
        x = torch.randn((2, 3) + (4,) * dim)
        want = seq(x)
        torch.testing.assert_close(fuse_modules(seq, [["0", "1"]])(x), want)


def test_fuse_modules_in_eval_folds_a_renorm_layer_and_qat_refuses_it() -> None:
    # In eval a renorm layer is batch norm with its running statistics: torch's folds are exact.
    ref = _model().eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    ours = syncbn.convert_to_renorm(copy.deepcopy(ref)).eval()
    assert isinstance(ours[1], syncbn.SyncBatchRenorm2d) and isinstance(ours[8], syncbn.SyncBatchRenorm1d)
    want = ref(x)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=0)
    fused = fuse_modules(ours, GROUPS)
    assert type(fused[0]) is nni.ConvReLU2d and type(fused[3]) is nn.Conv2d and type(fused[7]) is nn.Linear
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-12)

    for dim in (1, 3):  # ConvTranspose, and the generic class
        for bn in (getattr(syncbn, f"SyncBatchRenorm{dim}d")(3), syncbn.SyncBatchRenorm(3)):
            seq = nn.Sequential(getattr(nn, f"ConvTranspose{dim}d")(3, 3, 1), bn).double().eval()
            with torch.no_grad():
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
            xt = torch.randn((2, 3) + (4,) * dim, dtype=torch.float64)
            want = seq(xt)
            torch.testing.assert_close(fuse_modules(seq, [["0", "1"]])(xt), want, rtol=0, atol=1e-12)

    pair = nn.Sequential(syncbn.SyncBatchRenorm2d(3), nn.ReLU()).eval()
    bn_relu = fuse_modules(pair, [["0", "1"]])[0]
    assert type(bn_relu) is nni.BNReLU2d and type(bn_relu[0]) is nn.BatchNorm2d

    # QAT: torch's modules fold batch norm's statistics, never r and d: a clear refusal.
    for model, group in (
        (syncbn.convert_to_renorm(_model()), ["0", "1", "2"]),
        (syncbn.convert_to_renorm(_model()), ["7", "8"]),
        (nn.Sequential(syncbn.SyncBatchRenorm2d(3), nn.ReLU()), ["0", "1"]),
    ):
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match=r"renorm layer cannot be fused for QAT \(got .*SyncBatchRenorm"):
            fuse_modules_qat(model.train(), [group])
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_fuse_modules_qat_and_prepare_qat_keep_the_synchronised_layer() -> None:
    model = syncbn.convert_sync_batchnorm(_model().float()).train()  # fake quantization is float32
    layers = [model[1], model[4], model[8]]
    fused = fuse_modules_qat(model, GROUPS, inplace=True)
    assert [type(fused[i]) for i in (0, 3, 7)] == [
        syncbn.quantization.ConvSyncBnReLU2d,
        syncbn.quantization.ConvSyncBn2d,
        syncbn.quantization.LinearSyncBn1d,
    ]
    assert isinstance(fused[0], nni.ConvBnReLU2d)  # still torch's fused class for isinstance checks
    fused.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    prepared = prepare_qat(fused, inplace=True)
    kinds = [nniqat.ConvBnReLU2d, nniqat.ConvBn2d, nniqat.LinearBn1d]
    for i, kind, layer in zip((0, 3, 7), kinds, layers):
        assert type(prepared[i]) is kind  # torch's own QAT class: torch's convert knows it
        assert prepared[i].bn is layer  # the synchronised layer itself, parameters and buffers
        assert prepared[i].bn.training
    prepared(torch.randn(4, 3, 6, 6))
    quantized = convert(prepared.eval())
    assert type(quantized[0]) is torch.ao.nn.intrinsic.quantized.ConvReLU2d  # the batch norm folded in

    pair = nn.Sequential(syncbn.SyncBatchNorm2d(3), nn.ReLU()).train()
    with pytest.raises(ValueError, match="no QAT module for BNReLU2d"):
        fuse_modules_qat(pair, [["0", "1"]])
    with pytest.raises(ValueError, match=r"num_features must equal .* \(got 3 and 4\)"):
        fuse_modules_qat(nn.Sequential(nn.Conv2d(2, 4, 1), syncbn.SyncBatchNorm2d(3)), [["0", "1"]])


def test_only_syncbn_types_are_added_to_torch_tables() -> None:
    from torch.ao.quantization import fuser_method_mappings as fm

    ours = syncbn.quantization.fuser_methods()
    assert all(any(issubclass(t, syncbn.SyncBatchNorm) for t in key) for key in ours)
    assert all(fm._DEFAULT_OP_LIST_TO_FUSER_METHOD[key] is not None for key in ours)
    assert syncbn.quantization.register()  # idempotent


def _prepared(model: nn.Module) -> nn.Module:
    fused = fuse_modules_qat(model.train(), GROUPS)
    fused.qconfig = _no_quantization()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat(fused)


def _qat_on_ranks(rank: int, world_size: int) -> dict[str, float]:
    ref = _prepared(_model())  # torch's own QAT modules with nn.BatchNorm, on the global batch
    ours = _prepared(syncbn.convert_sync_batchnorm(_model()))
    assert isinstance(ours[0].bn, syncbn.SyncBatchNorm2d) and type(ref[0].bn) is nn.BatchNorm2d
    gen = torch.Generator().manual_seed(1)
    errors = rank_steps_errors(ours, ref, rank, [3, 5], (3, 6, 6), gen, shift=1.0)
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        if a.is_floating_point():
            errors[name] = (a - b).abs().max().item()
    return errors


def test_qat_fused_modules_synchronise_exactly_on_two_ranks() -> None:
    results: list[Any] = launch(_qat_on_ranks, 2, timeout=120)
    for errors in results:
        assert len(errors) > 10 and max(errors.values()) < 1e-12, errors
