"""torch.export and ONNX export (both exporters) of an eval model with syncbn layers, run in onnxruntime.

Eval never communicates, so an exported eval model is a plain batch-norm graph.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import syncbn


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.BatchNorm1d(5),
    )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    ours = syncbn.convert_sync_batchnorm(model).eval()
    assert isinstance(ours[1], syncbn.SyncBatchNorm2d)
    return ours


def test_torch_export_of_an_eval_model() -> None:
    model = _model()
    x = torch.randn(4, 3, 8, 8)
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=1e-6)
    x2 = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(program.module()(x2), model(x2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_onnx_export_runs_in_onnxruntime(dynamo: bool, tmp_path: os.PathLike[str]) -> None:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    model = _model()
    x = torch.randn(4, 3, 8, 8)
    want = model(x).detach().numpy()
    path = os.path.join(tmp_path, "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and progress notes
        torch.onnx.export(copy.deepcopy(model), (x,), path, dynamo=dynamo, input_names=["x"])
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5)
