"""syncbn.lightning.SyncBatchNorm in a real Lightning Trainer on 2 CPU processes.

The Fabric recipe is in test_integrations_fabric.py (a launch of its own, run beside these).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import syncbn
from _helpers import torchvision_shim
from _helpers.integration_models import SubclassBN, make_net, max_error, reference_state, run_script

torchvision_shim.install()
L = pytest.importorskip("lightning.pytorch")
import syncbn.lightning  # noqa: E402

PLAIN_TYPES = [
    "Conv2d",
    "BatchNorm2d",
    "ReLU",
    "Conv2d",
    "SubclassBN",
    "ReLU",
    "Flatten",
    "Linear",
    "BatchNorm1d",
    "Linear",
]
SYNC_TYPES = [
    "Conv2d",
    "SyncBatchNorm2d",
    "ReLU",
    "Conv2d",
    "SyncBatchNorm2d",
    "ReLU",
    "Flatten",
    "Linear",
    "SyncBatchNorm1d",
    "Linear",
]


def test_plugin_is_a_layersync_that_converts_and_reverts_like_the_converter() -> None:
    plugin = syncbn.lightning.SyncBatchNorm()
    assert isinstance(plugin, L.plugins.LayerSync)
    net = make_net()
    weight = net[1].weight
    conv = plugin.apply(net)
    assert [type(m).__name__ for m in conv] == SYNC_TYPES and conv[1].weight is weight
    back = plugin.revert(conv)
    assert [type(m).__name__ for m in back] == PLAIN_TYPES and type(back[4]) is SubclassBN
    group = object()
    assert syncbn.lightning.SyncBatchNorm(group).apply(nn.BatchNorm2d(2)).process_group is group
    with pytest.raises(RuntimeError, match="init_process_group"):  # group_size: syncbn.groups.subgroup
        syncbn.lightning.SyncBatchNorm(group_size="node").apply(nn.BatchNorm2d(2))
    # The Trainer takes it as its layer-sync plugin (without sync_batchnorm=True).
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_progress_bar=False
    )
    assert trainer._accelerator_connector._layer_sync is plugin


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_trainer_on_two_cpu_processes_trains_with_syncbn_and_equals_the_full_batch(
    strategy: str, tmp_path: os.PathLike[str]
) -> None:
    run_script("run_lightning.py", strategy, str(tmp_path), timeout=480)
    ref = reference_state()
    for rank in (0, 1):
        assert torch.load(os.path.join(tmp_path, f"train_types_rank{rank}.pt")) == SYNC_TYPES
    ranks = (0, 1) if strategy == "ddp" else (0,)  # ddp_spawn: the main process gets rank 0's weights
    for rank in ranks:
        final = torch.load(os.path.join(tmp_path, f"final_rank{rank}.pt"))
        assert final["types"] == PLAIN_TYPES  # the Trainer's teardown reverted the plugin's conversion
        assert max_error(final["state"], ref) < 1e-12
