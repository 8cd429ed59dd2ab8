"""The accelerate recipe with a ``DeviceMesh`` on 4 CPU processes (accelerate's notebook launcher, forked).

``python run_accelerate_mesh.py OUT_DIR PORT``, or ``main(OUT_DIR, PORT)``, which
tests/test_integrations_accelerate.py calls in a fork of its own process (accelerate imported).
Each rank saves what it saw; the test compares it with ``nn.BatchNorm`` on the global batches.

- accelerate 1.15 refuses a ``ParallelismConfig`` on CPU (``DistributedType.MULTI_CPU``): its error
  is recorded, then the script starts again with a plain ``Accelerator(cpu=True)``.
- ``"tp"``: a 2x2 mesh ``("dp_shard", "tp")`` built with ``init_device_mesh`` after the
  ``Accelerator`` started the process group; syncbn over ``mesh["dp_shard"]``; accelerate's
  ``prepare_data_loader(..., torch_device_mesh=mesh)`` gives both ranks of a tp group the same
  batches. ``accelerator.prepare`` wraps the model in DDP over all 4 ranks.
- ``"hsdp"`` and ``"hsdp_2d"``: the mesh accelerate's ``ParallelismConfig(dp_replicate_size=2,
  dp_shard_size=2)`` builds (its ``build_device_mesh``, the function ``Accelerator`` calls for
  ``accelerator.torch_device_mesh``, called here directly); syncbn over its flattened ``"dp"``
  dimension, and over ``mesh["dp_replicate", "dp_shard"]`` (flattened by syncbn). 4 data shards.
- ``"dp_named_rows"``: the rows accelerate's loader gives a mesh named ``("dp", "tp")`` (accelerate
  reads the names ``dp_replicate``, ``dp_shard``, ``tp``, ``cp``: ``"dp"`` is not one of them).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import torch  # noqa: E402

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, ParallelismConfig, notebook_launcher  # noqa: E402
from accelerate.data_loader import prepare_data_loader  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import syncbn  # noqa: E402
from _helpers.integration_models import make_data, make_net  # noqa: E402
from syncbn.groups import _mesh  # noqa: E402

GLOBAL = 8  # samples per data-parallel group and step: 3 steps over make_data's 24 samples
LR = 0.1


def _loader(mesh: Any, data_parallel: int, device: torch.device) -> Any:
    """accelerate's data loader over the mesh: rows, inputs and upstream gradients (make_data's targets)."""
    x, g = make_data()
    rows = torch.arange(len(x))
    plain = DataLoader(TensorDataset(rows, x, g), batch_size=GLOBAL // data_parallel)
    return prepare_data_loader(plain, device, torch_device_mesh=mesh)


def _train(accelerator: Accelerator, sync_mesh: Any, loader: Any) -> dict[str, Any]:
    """The recipe (convert with the mesh, then prepare), trained over ``loader``: what each step gave."""
    model = syncbn.convert_sync_batchnorm(make_net(), device_mesh=sync_mesh)
    layer = model[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps = []
    for rows, x, g in loader:
        x = x.clone().requires_grad_()
        optimizer.zero_grad()
        y = model(x)
        accelerator.backward((y * g).sum())  # a random upstream gradient; DDP averages over the ranks
        steps.append(
            {
                "rows": rows,
                "y": y.detach(),
                "dx": x.grad,
                "grads": [p.grad.clone() for p in model.parameters()],  # type: ignore[union-attr]
            }
        )
        optimizer.step()
    plain = syncbn.revert_sync_batchnorm(accelerator.unwrap_model(model))
    return {
        "steps": steps,
        "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
        "members": dist.get_process_group_ranks(_mesh.group_of(layer.process_group)),
        "holds_mesh": _mesh.is_mesh(layer.process_group),
    }


def train(out: str) -> None:
    bound = [InitProcessGroupKwargs(timeout=timedelta(seconds=60))]  # a mistake ends in a minute
    try:  # accelerate's own mesh: refused on CPU
        config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
        Accelerator(cpu=True, parallelism_config=config, kwargs_handlers=bound)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    AcceleratorState._reset_state()  # forget it, as accelerate's own tests do (the process group stays)
    accelerator = Accelerator(cpu=True, kwargs_handlers=bound)
    result: dict[str, Any] = {
        "refused": refused,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "accelerator_mesh": accelerator.torch_device_mesh,
    }

    # (dp, tp) = (2, 2): tp peers (0, 1) and (2, 3) see the same samples; syncbn over dp.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    result["tp"] = _train(accelerator, mesh["dp_shard"], _loader(mesh, 2, accelerator.device))

    # HSDP's 2-D data-parallel mesh as accelerate lays it out (with its flattened "dp" dimension).
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).build_device_mesh("cpu")
    result["hsdp_names"] = list(hsdp.mesh_dim_names)
    result["hsdp"] = _train(accelerator, hsdp["dp"], _loader(hsdp, 4, accelerator.device))
    both = hsdp["dp_replicate", "dp_shard"]
    result["hsdp_2d"] = _train(accelerator, both, _loader(hsdp, 4, accelerator.device))

    # A mesh whose data-parallel dimension is named "dp": the rows accelerate's loader gives.
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result["dp_named_rows"] = [rows for rows, _, _ in _loader(named, 2, accelerator.device)]
    torch.save(result, os.path.join(out, f"accelerate_mesh_rank{accelerator.process_index}.pt"))


def main(out: str, port: str) -> None:
    """accelerate's notebook launcher: 4 forked processes run :func:`train`, on ``port``."""
    notebook_launcher(train, args=(out,), num_processes=4, use_port=port)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
