"""torch.fx symbolic tracing of converted models: one node per layer, and the traced module synchronises.

Also torchvision's ``create_feature_extractor`` (built on FX) on a converted ResNet-50.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import syncbn
from _helpers import torchvision_shim as _torchvision_shim
from _helpers.compare import rank_steps_errors
from _helpers.dist_harness import launch


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 1),
        nn.BatchNorm2d(4, momentum=None),
        nn.Flatten(2),
        nn.BatchNorm1d(4),
    ).double()


class _Scaled(syncbn.SyncBatchNorm2d):
    """A user's subclass that does more around the layer's forward (traced through, layer part kept)."""

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        return 2.0 * super().forward(input) + 1.0


def _nodes(gm: torch.fx.GraphModule) -> list[tuple[str, Any]]:
    return [(n.op, n.target) for n in gm.graph.nodes]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_symbolic_trace_records_each_layer_as_one_call_module_node(mode: str) -> None:
    torch.manual_seed(0)
    ref = _model()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    getattr(ours, mode)()
    getattr(ref, mode)()
    gm = torch.fx.symbolic_trace(ours)
    assert _nodes(gm) == _nodes(torch.fx.symbolic_trace(ref))  # the graph of the unconverted model
    assert isinstance(gm.get_submodule("1"), syncbn.SyncBatchNorm2d)
    for _ in range(2):  # the traced module is the module: outputs, gradients, running statistics
        x = torch.randn(5, 3, 4, 4, dtype=torch.float64) + 3
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = gm(x1), ref(x2)
        torch.testing.assert_close(y1, y2, rtol=0, atol=1e-12)
        g = torch.randn_like(y1)
        y1.backward(g)
        y2.backward(g)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-12)
    for (name, a), b in zip(gm.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    # the mode is read when the graph runs: the same GraphModule switches like the module
    gm.train(mode == "eval")
    assert gm.get_submodule("4").training is (mode == "eval")


def test_symbolic_trace_of_in_place_masked_and_subclassed_layers() -> None:
    torch.manual_seed(1)
    inplace = nn.Sequential(nn.Conv2d(3, 4, 1), syncbn.InPlaceSyncBatchNorm2d(4, activation="leaky_relu"))
    gm = torch.fx.symbolic_trace(inplace)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "call_module", "output"]
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(gm(x), copy.deepcopy(inplace)(x))

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = syncbn.SyncBatchNorm2d(3)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            return self.bn(x, mask)

    masked = Masked().double()
    gm = torch.fx.symbolic_trace(masked)
    call = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(call) == 1 and len(call[0].args) == 2
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    mask = torch.rand(4, 5, 5) > 0.3
    torch.testing.assert_close(gm(x, mask), copy.deepcopy(masked)(x, mask), rtol=0, atol=0)

    sub = nn.Sequential(_Scaled(3)).double()
    gm = torch.fx.symbolic_trace(sub)
    ops = [n.op for n in gm.graph.nodes]
    assert ops.count("get_attr") == 1 and "call_module" not in ops  # the subclass's extra work is traced
    ref = copy.deepcopy(sub)
    torch.testing.assert_close(gm(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(gm.get_submodule("0").running_var, ref[0].running_var, rtol=0, atol=0)


def test_compat_layers_trace_and_traced_modules_pickle() -> None:
    from syncbn.compat import inplace_abn, megengine

    torch.manual_seed(2)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    for layer in (
        inplace_abn.ABN(3),
        inplace_abn.InPlaceABN(3),
        inplace_abn.InPlaceABNSync(3),
        megengine.SyncBatchNorm(3),  # its forward calls SyncBatchNorm.forward: a call_forward node
        _Scaled(3),
    ):
        model = nn.Sequential(nn.Conv2d(3, 3, 1), layer).double()
        ref = copy.deepcopy(model)
        gm = torch.fx.symbolic_trace(model)
        ops = [n.op for n in gm.graph.nodes]
        assert ops.count("call_module") + ops.count("get_attr") == 2, (type(layer).__name__, ops)
        buffer = io.BytesIO()
        torch.save(gm, buffer)  # the graph's targets are importable
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for module in (gm, loaded):
            torch.testing.assert_close(module(x.clone()), ref(x.clone()), rtol=0, atol=1e-12)


def _traced_on_ranks(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    ref = _model()
    ours = torch.fx.symbolic_trace(syncbn.convert_sync_batchnorm(copy.deepcopy(ref)))
    gen = torch.Generator().manual_seed(1)
    errors = rank_steps_errors(ours, ref, rank, [3, 5], (3, 4, 4), gen, shift=5.0)  # uneven batches
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        errors[name] = (a.double() - b.double()).abs().max().item()
    ours.eval()
    ref.eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=gen)
    errors["eval"] = (ours(x) - ref(x)).abs().max().item()
    return errors


def test_traced_graph_module_synchronises_on_two_ranks() -> None:
    for errors in launch(_traced_on_ranks, 2, timeout=120):
        assert max(errors.values()) < 1e-12, errors


def test_create_feature_extractor_on_converted_resnet50() -> None:
    _torchvision_shim.install()
    models = pytest.importorskip("torchvision.models")
    fx = pytest.importorskip("torchvision.models.feature_extraction")
    torch.manual_seed(0)
    ref = models.resnet50()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    assert fx.get_graph_node_names(ours) == fx.get_graph_node_names(ref)  # the same node names
    nodes = {"layer1.0.bn1": "bn", "layer2": "c3", "layer4": "c5"}
    x = torch.randn(2, 3, 32, 32)  # the smallest input resnet50's five halvings keep (1x1 at layer4)
    for mode in ("eval", "train"):
        got = fx.create_feature_extractor(getattr(ours, mode)(), return_nodes=nodes)
        want = fx.create_feature_extractor(getattr(ref, mode)(), return_nodes=nodes)
        assert isinstance(got.get_submodule("layer1.0.bn1"), syncbn.SyncBatchNorm2d)
        a, b = got(x), want(x)
        assert a.keys() == b.keys() == {"bn", "c3", "c5"}
        for key in a:
            torch.testing.assert_close(a[key], b[key], msg=f"{mode} {key}")
