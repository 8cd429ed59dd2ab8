"""Train with Hugging Face accelerate and syncbn: convert the model before ``accelerator.prepare``.

accelerate has no SyncBatchNorm switch of its own. Run with::

    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py   # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_train.py
    python examples/accelerate_train.py --notebook       # accelerate's notebook launcher, 2 CPU processes

Needs ``pip install "syncbn[accelerate]"``.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator, notebook_launcher
from torch import nn

import syncbn


def train(steps: int = 20, cpu: bool = False) -> None:
    accelerator = Accelerator(cpu=cpu)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    model = syncbn.convert_sync_batchnorm(model)  # the recipe: convert, then prepare
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    g = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own data
    for step in range(steps):
        x = torch.randn(16, 3, 16, 16, generator=g).to(accelerator.device)
        y = torch.randint(0, 10, (16,), generator=g).to(accelerator.device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        if step % 5 == 0:
            accelerator.print(f"step {step}: loss {loss.item():.4f} on {accelerator.num_processes} processes")

    plain = syncbn.revert_sync_batchnorm(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        torch.save(plain.state_dict(), "accelerate_model.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--notebook", action="store_true", help="start 2 CPU processes from this script")
    args = parser.parse_args()
    if args.notebook:
        notebook_launcher(train, args=(args.steps, True), num_processes=2)
    else:
        train(args.steps)


if __name__ == "__main__":
    main()
