"""Train with Lightning Fabric on 2 CPU processes, syncbn-converted before ``fabric.setup``.

Run by tests/_helpers/run_lightning.py in the processes its ``ddp`` Trainer started, after the
Trainer's fit (``train(OUT_DIR)``: Fabric finds those processes and their process group); on its
own, ``python run_fabric.py OUT_DIR`` (Fabric's ddp launcher starts the second process by running
this script again).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _helpers import torchvision_shim  # noqa: E402  (before lightning imports torchvision)

torchvision_shim.install()

import torch  # noqa: E402

torch.set_num_threads(1)

from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402

import syncbn  # noqa: E402
from _helpers.integration_models import STEPS, make_data, make_net, shard  # noqa: E402


def train(out: str) -> None:
    """The recipe; each rank writes ``fabric_rank{R}.pt`` to ``out``."""
    # The model is float64 itself; Fabric's "64-true" would cast its outputs back to float32.
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    net = make_net()
    plain_types = [type(m) for m in net]
    model = syncbn.convert_sync_batchnorm(net)  # the recipe: convert, then setup
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    train_types = [type(m).__name__ for m in net]
    x, y = make_data()
    for step in range(STEPS):
        rows = shard(fabric.global_rank, step)
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
    plain = syncbn.revert_sync_batchnorm(net)
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
            "train_types": train_types,
            "reverted_same": [type(m) for m in plain] == plain_types,
        },
        os.path.join(out, f"fabric_rank{fabric.global_rank}.pt"),
    )


if __name__ == "__main__":
    train(sys.argv[1])
