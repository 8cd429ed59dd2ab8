"""Train with Lightning Fabric and syncbn: convert the model, then ``fabric.setup`` it.

Fabric has no LayerSync hook; the conversion is one call before ``setup``.
Run with::

    python examples/fabric_train.py                         # 2 CPU processes
    python examples/fabric_train.py --accelerator gpu --devices 8

Needs ``pip install "syncbn[lightning]"``.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch import nn

import syncbn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="ddp")
    fabric.launch()
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    model = syncbn.convert_sync_batchnorm(model)  # the recipe: convert, then setup
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    g = torch.Generator().manual_seed(fabric.global_rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(16, 3, 16, 16, generator=g).to(fabric.device)
        y = torch.randint(0, 10, (16,), generator=g).to(fabric.device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        if step % 5 == 0:
            fabric.print(f"step {step}: loss {loss.item():.4f}")

    plain = syncbn.revert_sync_batchnorm(model.module)  # plain nn.BatchNorm2d for export
    if fabric.global_rank == 0:
        torch.save(plain.state_dict(), "fabric_model.pt")


if __name__ == "__main__":
    main()
