"""Train a LightningModule with syncbn's LayerSync plugin (instead of ``sync_batchnorm=True``).

Run with::

    python examples/lightning_train.py                      # 2 CPU processes, strategy="ddp"
    python examples/lightning_train.py --strategy ddp_spawn
    python examples/lightning_train.py --accelerator gpu --devices 8

Needs ``pip install "syncbn[lightning]"``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import syncbn.lightning


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_start(self) -> None:
        kinds = sorted({type(m).__name__ for m in self.net if "BatchNorm" in type(m).__name__})
        self.print(f"normalisation layers while training: {kinds}")  # SyncBatchNorm2d

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 3, 16, 16, generator=g), torch.randint(0, 10, (256,), generator=g))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        plugins=[syncbn.lightning.SyncBatchNorm()],  # the one line
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
    )
    model = Classifier()
    trainer.fit(model, DataLoader(data, batch_size=16))
    # The Trainer reverted the layers after fitting: plain nn.BatchNorm2d again.
    trainer.print(f"after fit: {type(model.net[1]).__name__}")


if __name__ == "__main__":
    main()
