"""``syncbn.accumulation`` in the integrated trainers, both ``normalize`` modes from one launch each.

A real Lightning Trainer (``syncbn.lightning.AccumulatedStatistics``, ``accumulate_grad_batches=3``)
and the documented accelerate recipe (``gradient_accumulation_steps=3``), 2 CPU processes each.
Each launch runs ``normalize="micro-batch"`` and then ``"cumulative"`` (CmBN) on a fresh model in
the same processes (tests/_helpers/run_lightning_accumulation.py, run_accelerate_accumulation.py);
a module-scoped fixture launches once and the tests below read its results. The references are
in the scripts: a plain ``nn.BatchNorm2d`` run once per optimizer step on the first layer's inputs
of that step's micro-batches of both ranks, and for CmBN after each micro-batch the count and mean
of the step's inputs of both ranks so far.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

import pytest
import torch

import syncbn
from _helpers.integration_models import run_script

pytestmark = pytest.mark.timeout(600)

TOL = 1e-12  # tests/test_accumulation.py's bound (micro-batch)
CMBN_TOL = 1e-10  # tests/test_cmbn.py's bound (cumulative)


def _load(out: Any, name: str) -> list[dict[str, dict[str, Any]]]:
    return [torch.load(os.path.join(out, f"{name}_rank{rank}.pt")) for rank in (0, 1)]


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    out = tmp_path_factory.mktemp("lightning_accumulation")
    run_script("run_lightning_accumulation.py", str(out), timeout=480)
    return _load(out, "lightning_accumulation")


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    pytest.importorskip("accelerate")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path_factory.mktemp("accelerate_accumulation")
    run_script("run_accelerate_accumulation.py", str(out), port, timeout=480)
    return _load(out, "accumulation")


def test_accelerate_recipe(accelerate_results: list[dict[str, dict[str, Any]]]) -> None:
    for result in (r["micro-batch"] for r in accelerate_results):
        assert result["world"] == 2 and result["commits"] == 2
        assert result["batches"] == 2  # one update per optimizer step, not per micro-batch
        assert max(result["errors"]) < TOL, result["errors"]


def test_lightning_callback(lightning_results: list[dict[str, dict[str, Any]]]) -> None:
    for result in (r["micro-batch"] for r in lightning_results):
        assert len(result["errors"]) == 2 and result["batches"] == 2, result
        assert result["group"] == [0, 1]  # SyncBatchNorm(group_size=2): subgroup(2) of 2 ranks
        assert max(result["errors"]) < TOL, result["errors"]


def test_lightning_callback_takes_the_option(lightning_results: list[dict[str, dict[str, Any]]]) -> None:
    # A real Trainer, 2 CPU processes, accumulate_grad_batches=3: after each micro-batch the first
    # layer's carry holds the count and mean of the step's inputs of both ranks so far; after each
    # step its running statistics hold one nn.BatchNorm2d update over them.
    with pytest.raises(ValueError, match="expected normalize one of"):
        syncbn.accumulate.check_normalize("per-step")
    for result in (r["cumulative"] for r in lightning_results):
        assert len(result["errors"]) == 2 + 6 and result["batches"] == 2, result
        assert max(result["errors"]) < CMBN_TOL, result["errors"]


def test_accelerate_recipe_takes_the_option(accelerate_results: list[dict[str, dict[str, Any]]]) -> None:
    # The documented recipe with normalize="cumulative", 2 CPU processes, gradient_accumulation_steps=3:
    # after each micro-batch the first layer's carry holds the window's inputs of both ranks so far;
    # after each window its running statistics one nn.BatchNorm2d update over them.
    for result in (r["cumulative"] for r in accelerate_results):
        assert result["world"] == 2 and result["commits"] == 2 and result["batches"] == 2
        assert len(result["errors"]) == 6 + 2 and max(result["errors"]) < CMBN_TOL, result["errors"]
