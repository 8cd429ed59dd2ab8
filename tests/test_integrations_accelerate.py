"""The accelerate recipes through accelerate's launcher: convert before ``prepare`` (2 CPU processes),
and with a ``DeviceMesh`` (4 CPU processes: a (dp, tp) mesh and HSDP's 2-D data-parallel mesh).

The 2-process launch (tests/_helpers/run_accelerate.py) also runs the ``syncbn.accumulation``
recipe (``gradient_accumulation_steps=3``) with ``normalize="micro-batch"`` and ``"cumulative"``
(tests/_helpers/run_accelerate_accumulation.py): it is launched once and three tests read it. At
each commit a plain ``nn.BatchNorm2d`` has run once on the first layer's inputs of the window's
micro-batches of both ranks; for CmBN after each micro-batch the carry holds the count and mean of
the window's inputs of both ranks so far.

Each launcher (accelerate's ``notebook_launcher``, which forks the ranks) runs in a fork of this
process, accelerate already imported (tests/_helpers/forked.py), not in a fresh interpreter.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.forked import run_forked
from _helpers.integration_models import make_data, make_net, max_error, reference_state

pytest.importorskip("accelerate")

SYNC_TYPES = (
    "Conv2d SyncBatchNorm2d ReLU Conv2d SyncBatchNorm2d ReLU Flatten Linear SyncBatchNorm1d Linear".split()
)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _script_main(script: str, out: str) -> None:
    """In the forked child: ``python tests/_helpers/SCRIPT.py OUT PORT``, without a new interpreter."""
    import importlib

    os.environ["OMP_NUM_THREADS"] = "1"
    importlib.import_module(f"_helpers.{script}").main(out, _free_port())


def _run(script: str, out: str) -> None:
    run_forked(_script_main, script, out, log=os.path.join(out, f"{script}.log"), timeout=480)


_launched: list[str] = []


def _launch(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The output folder of ``run_accelerate.py``, launched once per module."""
    if not _launched:
        out = str(tmp_path_factory.mktemp("accelerate"))
        _run("run_accelerate", out)
        _launched.append(out)
    return _launched[0]


def _accumulation(tmp_path_factory: pytest.TempPathFactory, normalize: str) -> list[dict[str, Any]]:
    out = _launch(tmp_path_factory)
    return [torch.load(os.path.join(out, f"accumulation_rank{rank}.pt"))[normalize] for rank in (0, 1)]


@pytest.mark.timeout(600)
def test_accelerate_recipe_on_two_cpu_processes_equals_the_full_batch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmp_path = _launch(tmp_path_factory)
    ref = reference_state()
    for rank in (0, 1):
        result = torch.load(os.path.join(tmp_path, f"accelerate_rank{rank}.pt"))
        assert result["world"] == 2 and result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["train_types"] == SYNC_TYPES and result["reverted_same"]
        assert max_error(result["state"], ref) < 1e-12


@pytest.mark.timeout(600)
def test_accelerate_recipe(tmp_path_factory: pytest.TempPathFactory) -> None:
    for result in _accumulation(tmp_path_factory, "micro-batch"):
        assert result["world"] == 2 and result["commits"] == 2
        assert result["batches"] == 2  # one update per optimizer step, not per micro-batch
        assert max(result["errors"]) < 1e-12, result["errors"]


@pytest.mark.timeout(600)
def test_accelerate_recipe_takes_the_option(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The documented recipe with normalize="cumulative", 2 CPU processes, gradient_accumulation_steps=3:
    # after each micro-batch the first layer's carry holds the window's inputs of both ranks so far;
    # after each window its running statistics one nn.BatchNorm2d update over them.
    with pytest.raises(ValueError, match="expected normalize one of"):
        syncbn.accumulate.check_normalize("per-step")
    for result in _accumulation(tmp_path_factory, "cumulative"):
        assert result["world"] == 2 and result["commits"] == 2 and result["batches"] == 2
        assert len(result["errors"]) == 6 + 2 and max(result["errors"]) < 1e-10, result["errors"]


MESH_STEPS, MESH_GLOBAL, MESH_LR = 3, 8, 0.1  # those of tests/_helpers/run_accelerate_mesh.py
MESH_TOL = 1e-10


def _mesh_reference(data_parallel: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """``nn.BatchNorm`` in one process on each step's global batch, the loss averaged over the
    ``data_parallel`` ranks as DDP averages their gradients: each step's outputs, input gradients
    (scaled to one rank's own loss) and parameter gradients, and the trained state."""
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=MESH_LR)
    x, g = make_data()
    steps = []
    for step in range(MESH_STEPS):
        rows = slice(step * MESH_GLOBAL, (step + 1) * MESH_GLOBAL)
        xb = x[rows].clone().requires_grad_()
        optimizer.zero_grad()
        y = model(xb)
        y.backward(g[rows] / data_parallel)
        assert xb.grad is not None
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        steps.append({"y": y.detach(), "dx": xb.grad * data_parallel, "grads": grads})
        optimizer.step()
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mesh_case_error(got: dict[str, Any], shard: int, data_parallel: int) -> float:
    """Largest difference of one rank's run from the reference; checks the rows it was given."""
    steps, state = _mesh_reference(data_parallel)
    per = MESH_GLOBAL // data_parallel
    errors = [max_error(got["state"], state)]
    assert len(got["steps"]) == MESH_STEPS
    for step, (mine, ref) in enumerate(zip(got["steps"], steps)):
        start = step * MESH_GLOBAL + shard * per
        assert mine["rows"].tolist() == list(range(start, start + per))
        local = slice(shard * per, (shard + 1) * per)
        errors += [(mine[k] - ref[k][local]).abs().max().item() for k in ("y", "dx")]
        errors += [(a - b).abs().max().item() for a, b in zip(mine["grads"], ref["grads"], strict=True)]
    return max(errors)


def _identical(a: Any, b: Any) -> bool:
    """Bit-identical nested results (tensors compared with ``torch.equal``)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.timeout(600)
def test_accelerate_recipe_with_a_device_mesh_on_four_cpu_processes(tmp_path: os.PathLike[str]) -> None:
    _run("run_accelerate_mesh", str(tmp_path))
    results = [torch.load(os.path.join(tmp_path, f"accelerate_mesh_rank{r}.pt")) for r in range(4)]
    for result in results:
        # accelerate 1.15 refuses its ParallelismConfig on CPU; the recipe builds the mesh itself.
        refused = result["refused"]
        assert refused is not None and "ParallelismConfig is only compatible" in refused
        assert "but got DistributedType.MULTI_CPU" in refused
        assert result["world"] == 4 and result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["accelerator_mesh"] is None
        assert result["hsdp_names"] == ["dp_replicate", "dp_shard"]
        # A data-parallel dimension named "dp" is not one accelerate's loader reads: all rows everywhere.
        every_row = [list(range(i, i + 4)) for i in range(0, 24, 4)]
        assert [r.tolist() for r in result["dp_named_rows"]] == every_row
    # (dp_shard, tp) = (2, 2): dp groups {0, 2} and {1, 3}; tp peers (0, 1) and (2, 3) share a shard.
    for rank, result in enumerate(results):
        got = result["tp"]
        assert got["holds_mesh"] and got["members"] == [rank % 2, rank % 2 + 2]
        assert _mesh_case_error(got, rank // 2, 2) < MESH_TOL
    for a, b in ((0, 1), (2, 3)):  # tp peers: every step and the trained state, bit for bit
        assert all(_identical(results[a]["tp"][k], results[b]["tp"][k]) for k in ("steps", "state"))
    # HSDP (dp_replicate, dp_shard) = (2, 2): accelerate's flattened "dp", and the 2-D submesh.
    for key in ("hsdp", "hsdp_2d"):
        for rank, result in enumerate(results):
            assert result[key]["holds_mesh"] and result[key]["members"] == [0, 1, 2, 3]
            assert _mesh_case_error(result[key], rank, 4) < MESH_TOL, key
