"""The Lightning Fabric recipe (convert before ``fabric.setup``) on 2 CPU processes.

A file of its own: the test runner hands whole files to its workers, so this launch (fresh
interpreters that import Lightning) can run beside the Trainer's in test_integrations_lightning.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from _helpers import torchvision_shim
from _helpers.integration_models import max_error, reference_state, run_script

torchvision_shim.install()
pytest.importorskip("lightning.fabric")

SYNC_TYPES = (
    "Conv2d SyncBatchNorm2d ReLU Conv2d SyncBatchNorm2d ReLU Flatten Linear SyncBatchNorm1d Linear".split()
)


@pytest.mark.timeout(600)
def test_fabric_recipe_on_two_cpu_processes_equals_the_full_batch(tmp_path: os.PathLike[str]) -> None:
    run_script("run_fabric.py", str(tmp_path), timeout=480)
    ref = reference_state()
    for rank in (0, 1):
        result = torch.load(os.path.join(tmp_path, f"fabric_rank{rank}.pt"))
        assert result["train_types"] == SYNC_TYPES and result["reverted_same"]
        assert max_error(result["state"], ref) < 1e-12
