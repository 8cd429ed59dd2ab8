"""OpenMMLab: syncbn's layers by name in mmengine's MODELS, mmcv's build_norm_layer and ConvModule, Runner.

Runs against the real mmengine and mmcv-lite (``pip install "syncbn[mmengine]"``); skipped without them.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers import torchvision_shim as _torchvision_shim
from _helpers.dist_harness import launch

_torchvision_shim.install()  # mmengine's Runner imports torchvision (to log the environment)

pytest.importorskip("mmengine")
pytest.importorskip("mmcv.cnn")
from mmcv.cnn import ConvModule, build_norm_layer  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.registry import MODELS  # noqa: E402

from syncbn.integrations import mmengine as sbm  # noqa: E402


def test_build_norm_layer_returns_syncbn_layers_by_name() -> None:
    name, layer = build_norm_layer(dict(type="ExactSyncBN", requires_grad=True), 16)
    assert name == "bn" and type(layer) is syncbn.SyncBatchNorm and layer.num_features == 16
    assert all(p.requires_grad for p in layer.parameters())
    name, layer = build_norm_layer(dict(type="ExactSyncBN2d", requires_grad=False, momentum=0.3), 8, 1)
    assert name == "bn1" and type(layer) is syncbn.SyncBatchNorm2d and layer.momentum == 0.3
    assert not any(p.requires_grad for p in layer.parameters())
    _, layer = build_norm_layer(dict(type="ExactInPlaceSyncBN", activation="leaky_relu"), 8)
    assert type(layer) is syncbn.InPlaceSyncBatchNorm
    name, layer = build_norm_layer(dict(type="ExactSyncBNRenorm", r_max=2.0, d_max=0.5), 8)
    assert name == "bn" and type(layer) is syncbn.SyncBatchRenorm and (layer.r_max, layer.d_max) == (2.0, 0.5)
    for dim in (1, 3):
        assert type(build_norm_layer(dict(type=f"ExactSyncBN{dim}d"), 4)[1]) is getattr(
            syncbn, f"SyncBatchNorm{dim}d"
        )
    sbm.register()  # idempotent
    assert issubclass(MODELS.get("SyncBN"), nn.SyncBatchNorm)  # mmcv's name is left alone unless asked


def test_replace_syncbn_is_opt_in_and_undone() -> None:
    torch_cls = MODELS.get("SyncBN")  # mmengine's subclass of torch.nn.SyncBatchNorm
    assert issubclass(torch_cls, nn.SyncBatchNorm)
    try:
        sbm.replace_syncbn()
        sbm.replace_syncbn()  # twice: still one level to undo
        name, layer = build_norm_layer(dict(type="SyncBN", requires_grad=True), 4)
        assert name == "bn" and type(layer) is syncbn.SyncBatchNorm
        conv = ConvModule(3, 4, 3, norm_cfg=dict(type="SyncBN"))
        assert type(conv.bn) is syncbn.SyncBatchNorm
    finally:
        sbm.replace_syncbn(False)
    assert type(build_norm_layer(dict(type="SyncBN"), 4)[1]) is torch_cls


def test_replace_syncbn_undone_where_syncbn_was_not_registered() -> None:
    # mmengine without mmcv: no "SyncBN" entry before, none after the undo (mmcv's entry set aside here)
    mmcv_cls = MODELS.module_dict.pop("SyncBN")
    try:
        assert MODELS.get("SyncBN") is None
        sbm.replace_syncbn()
        assert MODELS.get("SyncBN") is syncbn.SyncBatchNorm
        sbm.replace_syncbn(False)
        assert "SyncBN" not in MODELS.module_dict and MODELS.get("SyncBN") is None
        sbm.replace_syncbn(False)  # nothing left to undo: still absent
        assert MODELS.get("SyncBN") is None
    finally:
        MODELS.module_dict["SyncBN"] = mmcv_cls


def test_conv_module_with_the_in_place_layer() -> None:
    torch.manual_seed(3)
    act = dict(type="LeakyReLU", negative_slope=0.01)
    ref = ConvModule(3, 4, 3, norm_cfg=dict(type="BN"), act_cfg=act)
    norm = dict(type="ExactInPlaceSyncBN", activation="leaky_relu")
    ours = ConvModule(3, 4, 3, norm_cfg=norm, act_cfg=None)  # the layer is the activation
    assert ours.norm_name == "bn" and type(ours.bn) is syncbn.InPlaceSyncBatchNorm
    ours.conv.load_state_dict(ref.conv.state_dict())
    x = torch.randn(4, 3, 6, 6)
    # init_weights sets weight 1: the in-place layer scales by |1| + eps, BN by 1
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-4)
    ours(x).square().mean().backward()
    assert ours.conv.weight.grad is not None


def test_a_model_built_with_mmcv_syncbn_converts() -> None:
    model = ConvModule(3, 4, 3, norm_cfg=dict(type="SyncBN", requires_grad=True))
    weight = model.bn.weight
    model = syncbn.convert_sync_batchnorm(model)  # mmengine's SyncBatchNorm adds no forward of its own
    assert type(model.bn) is syncbn.SyncBatchNorm and model.bn.weight is weight


def _stack_cfg(norm: str) -> list[dict[str, Any]]:
    return [
        dict(type="ConvModule", in_channels=3, out_channels=6, kernel_size=3, norm_cfg=dict(type=norm)),
        dict(type="ConvModule", in_channels=6, out_channels=4, kernel_size=1, norm_cfg=dict(type=norm)),
    ]


def _stack(norm: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MODELS.build(cfg) for cfg in _stack_cfg(norm))).double()


def test_model_from_a_config_file_with_custom_imports(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "cfg.py")
    with open(path, "w") as f:
        f.write(
            "custom_imports = dict(imports=['syncbn.integrations.mmengine'], allow_failed_imports=False)\n"
            f"model = {_stack_cfg('ExactSyncBN')!r}\n"
        )
    cfg = Config.fromfile(path)
    model = nn.Sequential(*(MODELS.build(c) for c in cfg.model))
    assert [type(m.bn) for m in model] == [syncbn.SyncBatchNorm] * 2
    assert list(model.state_dict()) == list(
        nn.Sequential(*(MODELS.build(c) for c in _stack_cfg("BN"))).state_dict()
    )


def _ddp_on_ranks(rank: int, world_size: int) -> dict[str, float]:
    ref = _stack("BN")
    ours = _stack("ExactSyncBN")
    ours.load_state_dict(ref.state_dict())
    ddp = nn.parallel.DistributedDataParallel(ours)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    sizes = [2, 5]
    start = sum(sizes[:rank])
    for _ in range(3):
        x = torch.randn(sum(sizes), 3, 6, 6, generator=gen, dtype=torch.float64) * 3 + 2
        g = torch.randn(sum(sizes), 4, 4, 4, generator=gen, dtype=torch.float64)
        ref_opt.zero_grad()
        (ref(x) * g).sum().div(world_size).backward()  # DDP averages the ranks' gradients
        ref_opt.step()
        opt.zero_grad()
        (ddp(x[start : start + sizes[rank]]) * g[start : start + sizes[rank]]).sum().backward()
        opt.step()
    errors = {k: (v - ref.state_dict()[k]).abs().max().item() for k, v in ours.state_dict().items()}
    ours.eval()
    ref.eval()
    errors["eval"] = (ours(x) - ref(x)).abs().max().item()
    return errors


def test_conv_module_stack_trained_under_ddp_equals_the_global_batch() -> None:
    for errors in launch(_ddp_on_ranks, 2, timeout=120):
        assert max(errors.values()) < 1e-10, errors


class _Net(BaseModel):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.body = _stack(norm)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor, mode: str = "tensor") -> Any:
        out = self.body(inputs)
        if mode == "loss":
            return {"loss": ((out - target) ** 2).mean()}
        return out


def _data(rank: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(sizes), 3, 6, 6, generator=gen, dtype=torch.float64) + 1
    y = torch.randn(sum(sizes), 4, 4, 4, generator=gen, dtype=torch.float64)
    if rank < 0:
        return x, y
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]], y[start : start + sizes[rank]]


def _runner_on_ranks(rank: int, world_size: int, work_dir: str) -> dict[str, float]:
    from mmengine.runner import Runner

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    sizes = [4, 4]  # each rank's batch: one iteration per step, the same batch every step
    # Three copies: the 3 iterations are one pass, with no restart of the loader (mmengine sleeps 2 s
    # at each restart).
    data = torch.utils.data.TensorDataset(*(t.repeat(3, 1, 1, 1) for t in _data(rank, sizes)))
    loader = torch.utils.data.DataLoader(data, batch_size=sizes[rank], shuffle=False)
    model = _Net("ExactSyncBN")
    ref = copy.deepcopy(_Net("BN"))
    ref.load_state_dict(model.state_dict())
    runner = Runner(
        model=model,
        work_dir=os.path.join(work_dir, str(rank)),
        train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=3, val_interval=100),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
        launcher="pytorch",  # the process group exists already: Runner uses it (no CUDA device set)
        cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)),  # CPU DDP
        env_cfg=dict(dist_cfg=dict(backend="gloo")),
        default_hooks=dict(checkpoint=None, logger=None),
        default_scope="mmengine",
    )
    runner.train()
    assert runner.iter == 3
    trained = runner.model.module
    assert type(trained.body[0].bn) is syncbn.SyncBatchNorm
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = _data(-1, sizes)
    for _ in range(3):  # the global batch: DDP's mean over equal shards is the mean over all
        opt.zero_grad()
        ref(x, y, mode="loss")["loss"].backward()
        opt.step()
    want = ref.state_dict()
    return {k: (v - want[k]).abs().max().item() for k, v in trained.state_dict().items()}


def test_mmengine_runner_with_pytorch_launcher_on_two_cpu_ranks(tmp_path: os.PathLike[str]) -> None:
    # What each rank's Runner imports (its visualizer, its environment report): once, here.
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import torchvision  # noqa: F401

    for errors in launch(_runner_on_ranks, 2, str(tmp_path), timeout=180):
        assert max(errors.values()) < 1e-10, errors
