"""Train with a real Lightning Trainer on 2 CPU processes and syncbn's LayerSync plugin.

``python run_lightning.py STRATEGY OUT_DIR``, or ``main(STRATEGY, OUT_DIR)`` in a process that
becomes the script: tests/test_integrations_lightning.py forks its own process (Lightning already
imported) and calls :func:`main` there, the Trainer's main process; ``ddp`` then starts the other
rank as a fresh interpreter running this script, ``ddp_spawn`` spawns both of its ranks fresh.
Each rank writes what it saw to OUT_DIR (layer types in training and after fit, final state).
With ``ddp`` the same two processes then run the Fabric recipe (tests/_helpers/run_fabric.py) and
the accumulation callback's two Trainers (tests/_helpers/run_lightning_accumulation.py): one launch
(one Lightning import per process) for all of them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _helpers import torchvision_shim  # noqa: E402  (before lightning imports torchvision)

torchvision_shim.install()

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning.pytorch as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import syncbn.lightning  # noqa: E402
from _helpers import run_fabric, run_lightning_accumulation  # noqa: E402
from _helpers.integration_models import PER_RANK, STEPS, WORLD, make_data, make_net, shard  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = make_net()
        self.out = out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        types = [type(m).__name__ for m in self.net]
        torch.save(types, os.path.join(self.out, f"train_types_rank{self.global_rank}.pt"))

    def train_dataloader(self) -> DataLoader:
        # This rank's shard of each global batch, in the reference's order.
        x, y = make_data()
        rows = torch.cat(
            [torch.arange(STEPS * WORLD * PER_RANK)[shard(self.global_rank, s)] for s in range(STEPS)]
        )
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=PER_RANK, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(strategy: str, out: str) -> None:
    """Fit with ``strategy``; in the main process, return once every rank it started has exited."""
    module = Module(out)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[syncbn.lightning.SyncBatchNorm()],
        precision="64-true",
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    types = [type(m).__name__ for m in module.net]
    torch.save({"state": state, "types": types}, os.path.join(out, f"final_rank{trainer.global_rank}.pt"))
    if strategy == "ddp":  # each process runs on: Fabric finds the processes the Trainer started
        run_fabric.train(out)
        run_lightning_accumulation.train(out)
    # ddp: the other rank, started by the launcher in this process (none in that rank), has written
    # its files once it exits.
    for proc in trainer.strategy.launcher.procs if strategy == "ddp" else []:
        if proc.wait() != 0:
            raise RuntimeError(f"rank process {proc.pid} exited with {proc.returncode}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
