"""torch.export and ONNX export (both exporters) of an eval model with syncbn layers, run in onnxruntime.

Eval never communicates, so an exported eval model is a plain batch-norm graph.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import syncbn
from _helpers.dist_harness import launch


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


def _export(rank: int, world_size: int) -> float:
    """The worst difference between the exported program and the model, as one process."""
    dist.destroy_process_group()
    model = _model()
    x, x2 = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    program = torch.export.export(model, (x,))
    return max(float((program.module()(v) - model(v)).abs().max()) for v in (x, x2))


def test_torch_export_of_an_eval_model() -> None:
    # In a child process: on torch 2.15, torch.export in the test process leaves autograd unusable
    # in ranks later tests fork from it ("Unable to handle autograd's threading in combination
    # with fork-based multiprocessing").
    (worst,) = launch(_export, 1)
    assert worst <= 1e-6


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
