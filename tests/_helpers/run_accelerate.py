"""Train with Hugging Face accelerate on 2 CPU processes (its notebook launcher, forked).

``python run_accelerate.py OUT_DIR PORT``, or ``main(OUT_DIR, PORT)``, which
tests/test_integrations_accelerate.py calls in a fork of its own process (accelerate imported).
The recipe: ``convert_sync_batchnorm`` before ``accelerator.prepare``. The same two processes then
run the ``syncbn.accumulation`` recipe with a fresh ``Accelerator(gradient_accumulation_steps=3)``
(tests/_helpers/run_accelerate_accumulation.py): one launch for both.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import torch  # noqa: E402

torch.set_num_threads(1)

from accelerate import Accelerator, notebook_launcher  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch import nn  # noqa: E402

import syncbn  # noqa: E402
from _helpers import run_accelerate_accumulation  # noqa: E402
from _helpers.integration_models import STEPS, make_data, make_net, shard  # noqa: E402


def recipe(out: str) -> None:
    """The recipe; each rank writes ``accelerate_rank{R}.pt`` to ``out``."""
    accelerator = Accelerator(cpu=True)
    net = make_net()
    plain_types = [type(m) for m in net]
    model = syncbn.convert_sync_batchnorm(net)  # the recipe: convert, then prepare
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    train_types = [type(m).__name__ for m in net]
    x, y = make_data()
    rank = accelerator.process_index
    for step in range(STEPS):
        rows = shard(rank, step)
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
    plain = syncbn.revert_sync_batchnorm(accelerator.unwrap_model(model))
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
            "train_types": train_types,
            "reverted_same": [type(m) for m in plain] == plain_types,
            "world": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
        },
        os.path.join(out, f"accelerate_rank{rank}.pt"),
    )


def train(out: str) -> None:
    recipe(out)
    # Forget this Accelerator, as accelerate's own tests do (the process group stays): the next one
    # accumulates gradients (its backward divides the loss by the steps, which the first must not).
    AcceleratorState._reset_state()
    GradientState._reset_state()
    run_accelerate_accumulation.train(out)


def main(out: str, port: str) -> None:
    """accelerate's notebook launcher: 2 forked processes run :func:`train`, on ``port``."""
    notebook_launcher(train, args=(out,), num_processes=2, use_port=port)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
