"""syncbn.lightning.SyncBatchNorm in a real Lightning Trainer on 2 CPU processes, and the Fabric recipe.

The Fabric recipe (convert before ``fabric.setup``) and ``syncbn.lightning.AccumulatedStatistics``
(``accumulate_grad_batches=3``; ``normalize="micro-batch"``, then ``"cumulative"``, a Trainer each)
run in the processes of the ``ddp`` Trainer's launch, after its fit (tests/_helpers/run_lightning.py):
one launch, read by four tests. The accumulation reference: a plain ``nn.BatchNorm2d`` run once per
optimizer step on the first layer's inputs of that step's micro-batches of both ranks, and for CmBN
after each micro-batch the count and mean of the step's inputs of both ranks so far.

Each launch's main process is a fork of this one (tests/_helpers/forked.py), made after the
``lightning`` fixture imported Lightning (about 6 s of CPU a process): it becomes the script
(``sys.argv`` and ``__main__``) and calls its ``main``. The ranks it starts are what a user's
launch starts: ``ddp`` runs the script again in a fresh interpreter for rank 1, ``ddp_spawn``
spawns two fresh interpreters.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

import syncbn
from _helpers import torchvision_shim
from _helpers.forked import run_forked
from _helpers.integration_models import SubclassBN, make_net, max_error, reference_state

# Lightning is imported by the test that runs it in this process (the `lightning` fixture), not at
# collection: every xdist worker collects every file, and the import costs about 2 s of CPU.
pytestmark = pytest.mark.skipif(not importlib.util.find_spec("lightning"), reason="lightning not installed")

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


@pytest.fixture(scope="module")
def lightning() -> Any:
    """``lightning.pytorch``, imported here (torchvision's shim first); ``syncbn.lightning`` with it."""
    torchvision_shim.install()
    L = pytest.importorskip("lightning.pytorch")
    import syncbn.lightning  # noqa: F401

    return L


def test_plugin_is_a_layersync_that_converts_and_reverts_like_the_converter(lightning: Any) -> None:
    L = lightning
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


_launched: dict[str, str] = {}
TESTS = os.path.dirname(os.path.abspath(__file__))


def _become_the_script(strategy: str, out: str) -> None:
    """In the forked child: act as ``python run_lightning.py STRATEGY OUT`` would, then run it."""
    import _helpers.run_lightning as script

    # Lightning's ddp launcher starts rank 1 as `python -m <__main__'s module> <argv[1:]>`.
    sys.modules["__main__"] = script
    sys.argv = [script.__file__, strategy, out]
    src = os.path.join(os.path.dirname(TESTS), "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, TESTS, os.environ.get("PYTHONPATH", "")])
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    script.main(strategy, out)


def _launch(strategy: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The output folder of ``run_lightning.py STRATEGY``, launched once per module from a fork."""
    if strategy not in _launched:
        out = str(tmp_path_factory.mktemp(f"lightning_{strategy}"))
        run_forked(_become_the_script, strategy, out, log=os.path.join(out, "launch.log"), timeout=480)
        _launched[strategy] = out
    return _launched[strategy]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_trainer_on_two_cpu_processes_trains_with_syncbn_and_equals_the_full_batch(
    strategy: str, tmp_path_factory: pytest.TempPathFactory, lightning: Any
) -> None:
    tmp_path = _launch(strategy, tmp_path_factory)
    ref = reference_state()
    for rank in (0, 1):
        assert torch.load(os.path.join(tmp_path, f"train_types_rank{rank}.pt")) == SYNC_TYPES
    ranks = (0, 1) if strategy == "ddp" else (0,)  # ddp_spawn: the main process gets rank 0's weights
    for rank in ranks:
        final = torch.load(os.path.join(tmp_path, f"final_rank{rank}.pt"))
        assert final["types"] == PLAIN_TYPES  # the Trainer's teardown reverted the plugin's conversion
        assert max_error(final["state"], ref) < 1e-12


@pytest.mark.timeout(600)
def test_fabric_recipe_on_two_cpu_processes_equals_the_full_batch(
    tmp_path_factory: pytest.TempPathFactory, lightning: Any
) -> None:
    tmp_path = _launch("ddp", tmp_path_factory)  # the Fabric recipe ran after the Trainer's fit
    ref = reference_state()
    for rank in (0, 1):
        result = torch.load(os.path.join(tmp_path, f"fabric_rank{rank}.pt"))
        assert result["train_types"] == SYNC_TYPES and result["reverted_same"]
        assert max_error(result["state"], ref) < 1e-12


def _accumulation(tmp_path_factory: pytest.TempPathFactory, normalize: str) -> list[dict[str, object]]:
    out = _launch("ddp", tmp_path_factory)
    return [torch.load(os.path.join(out, f"lightning_accumulation_rank{r}.pt"))[normalize] for r in (0, 1)]


@pytest.mark.timeout(600)
def test_lightning_callback(tmp_path_factory: pytest.TempPathFactory, lightning: Any) -> None:
    for result in _accumulation(tmp_path_factory, "micro-batch"):
        assert len(result["errors"]) == 2 and result["batches"] == 2, result
        assert result["group"] == [0, 1]  # SyncBatchNorm(group_size=2): subgroup(2) of 2 ranks
        assert max(result["errors"]) < 1e-12, result["errors"]


@pytest.mark.timeout(600)
def test_lightning_callback_takes_the_option(
    tmp_path_factory: pytest.TempPathFactory, lightning: Any
) -> None:
    # A real Trainer, 2 CPU processes, accumulate_grad_batches=3: after each micro-batch the first
    # layer's carry holds the count and mean of the step's inputs of both ranks so far; after each
    # step its running statistics hold one nn.BatchNorm2d update over them.
    with pytest.raises(ValueError, match="expected normalize one of"):
        syncbn.accumulate.check_normalize("per-step")
    for result in _accumulation(tmp_path_factory, "cumulative"):
        assert len(result["errors"]) == 2 + 6 and result["batches"] == 2, result
        assert max(result["errors"]) < 1e-10, result["errors"]
