"""The accelerate recipe (convert before ``prepare``) on 2 CPU processes through accelerate's launcher."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from _helpers.integration_models import max_error, reference_state, run_script

pytest.importorskip("accelerate")

SYNC_TYPES = (
    "Conv2d SyncBatchNorm2d ReLU Conv2d SyncBatchNorm2d ReLU Flatten Linear SyncBatchNorm1d Linear".split()
)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.timeout(600)
def test_accelerate_recipe_on_two_cpu_processes_equals_the_full_batch(tmp_path: os.PathLike[str]) -> None:
    run_script("run_accelerate.py", str(tmp_path), _free_port(), timeout=480)
    ref = reference_state()
    for rank in (0, 1):
        result = torch.load(os.path.join(tmp_path, f"accelerate_rank{rank}.pt"))
        assert result["world"] == 2 and result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["train_types"] == SYNC_TYPES and result["reverted_same"]
        assert max_error(result["state"], ref) < 1e-12
