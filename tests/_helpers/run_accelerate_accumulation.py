"""The documented accelerate recipe for ``syncbn.accumulation`` on 2 CPU processes (forked).

Run by tests/_helpers/run_accelerate.py in the processes of its launch (``train(OUT_DIR)``); on
its own, ``python run_accelerate_accumulation.py OUT_DIR PORT``. It runs the recipe twice, each
time on a fresh model: with ``normalize="micro-batch"``, then with ``normalize="cumulative"``
(whose first layer's carry must hold the count and mean of the window's inputs of both ranks so
far after each micro-batch).
``Accelerator(gradient_accumulation_steps=3)``: the block opens on the first micro-batch of a
window and commits where ``accelerator.sync_gradients`` is true. At each commit, a plain
``nn.BatchNorm2d`` (the shadow) runs once on the first syncbn layer's inputs of the window's
micro-batches of both ranks; the layer must then hold the shadow's statistics. Each rank writes
``accumulation_rank{R}.pt``: per normalize mode, the errors, commits, ``num_batches_tracked`` and world.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import torch  # noqa: E402

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, notebook_launcher  # noqa: E402
from torch import nn  # noqa: E402

import syncbn  # noqa: E402
from _helpers.integration_models import make_data, make_net  # noqa: E402

K = 3  # micro-batches per optimizer step
MICRO = 6  # micro-batches in all (two windows)
PER = 2  # samples per rank and micro-batch


def recipe(accelerator: Accelerator, normalize: str) -> dict[str, object]:
    """The recipe with ``normalize`` on a fresh model: what the checks saw."""
    model = syncbn.convert_sync_batchnorm(make_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    layer = accelerator.unwrap_model(model)[1]
    shadow = nn.BatchNorm2d(layer.num_features).double()
    shadow.load_state_dict(layer.state_dict())
    seen: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    window: list[torch.Tensor] = []  # the window's inputs of both ranks so far (cumulative)

    def check_carry(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        everyone: list[torch.Tensor | None] = [None] * accelerator.num_processes
        dist.all_gather_object(everyone, args[0].detach().clone())
        window.extend(t for t in everyone if t is not None)
        values = torch.cat(window).transpose(0, 1).reshape(window[0].shape[1], -1)
        carry = module.__dict__["_syncbn_cmbn"]
        assert float(carry.count) == values.shape[1]
        errors.append((carry.mean - values.mean(1)).abs().max().item())

    if normalize == "cumulative":
        layer.register_forward_hook(check_carry)
    x, y = make_data()
    rank, world = accelerator.process_index, accelerator.num_processes
    errors: list[float] = []
    commits = 0
    block = syncbn.accumulation(model, normalize=normalize)
    for micro in range(MICRO):
        rows = slice((micro * world + rank) * PER, (micro * world + rank + 1) * PER)
        if not block.active:
            block.begin()
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
            if accelerator.sync_gradients:
                block.commit()
                commits += 1
                everyone: list[list[torch.Tensor]] = [[] for _ in range(world)]
                dist.all_gather_object(everyone, seen)
                shadow(torch.cat([t for inputs in everyone for t in inputs]))
                seen.clear()
                window.clear()
                errors.append(
                    max(
                        (layer.running_mean - shadow.running_mean).abs().max().item(),
                        (layer.running_var - shadow.running_var).abs().max().item(),
                        float(abs(int(layer.num_batches_tracked) - int(shadow.num_batches_tracked))),
                    )
                )
            optimizer.step()
            optimizer.zero_grad()
    return {"errors": errors, "commits": commits, "batches": int(layer.num_batches_tracked), "world": world}


def train(out: str) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    # MICRO is a multiple of K: the second recipe's first micro-batch opens a window, too.
    results = {normalize: recipe(accelerator, normalize) for normalize in ("micro-batch", "cumulative")}
    torch.save(results, os.path.join(out, f"accumulation_rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    notebook_launcher(train, args=(sys.argv[1],), num_processes=2, use_port=sys.argv[2])
