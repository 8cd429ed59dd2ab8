"""``syncbn.lightning.AccumulatedStatistics``: a real Trainer, 2 CPU processes, ``accumulate_grad_batches=3``.

Run by tests/_helpers/run_lightning.py in the processes of its ``ddp`` launch (``train(OUT_DIR)``);
on its own, ``python run_lightning_accumulation.py OUT_DIR``.
Two ``Trainer.fit`` calls in the same processes (a fresh module and Trainer each): the
callback with ``normalize="micro-batch"``, then with ``"cumulative"`` (CmBN blocks, whose carry the
checker compares after each micro-batch with the inputs of both ranks so far). A checker callback
placed after syncbn's runs a plain ``nn.BatchNorm2d`` (the shadow) once per optimizer step on the
first syncbn layer's inputs of that step's micro-batches of both ranks; the layer must then hold
the shadow's statistics. Each rank writes ``lightning_accumulation_rank{R}.pt``: per normalize mode,
the checker's errors, the layer's ``num_batches_tracked`` and the plugin's group.
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
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import syncbn.lightning  # noqa: E402
from _helpers.integration_models import make_data, make_net  # noqa: E402

K = 3
PER = 2  # samples per rank and micro-batch; 24 samples: 6 micro-batches per rank, 2 steps


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        x, y = make_data()
        world, rank = 2, self.global_rank
        rows = torch.cat([torch.arange(m * world + rank, m * world + rank + 1) for m in range(6)])
        rows = torch.cat([torch.arange(r * PER, (r + 1) * PER) for r in rows.tolist()])
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=PER, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Check(L.Callback):
    def __init__(self, cumulative: bool) -> None:
        self.cumulative = cumulative
        self.seen: list[torch.Tensor] = []
        self.errors: list[float] = []
        self.shadow: nn.BatchNorm2d | None = None
        self.group: list[int] = []
        self.step: list[torch.Tensor] = []  # this step's inputs of both ranks so far (cumulative)

    def check_carry(self, layer: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """The pooled count and mean of this step's micro-batches of both ranks so far (cumulative)."""
        everyone: list[torch.Tensor | None] = [None, None]
        dist.all_gather_object(everyone, args[0].detach().clone())
        self.step += [t for t in everyone if t is not None]
        values = torch.cat(self.step).transpose(0, 1).reshape(self.step[0].shape[1], -1)
        carry = layer.__dict__.get("_syncbn_cmbn")
        assert carry is not None and float(carry.count) == values.shape[1]
        self.errors.append((carry.mean - values.mean(1)).abs().max().item())

    def on_train_start(self, trainer: L.Trainer, module: Module) -> None:
        layer = module.net[1]
        self.group = dist.get_process_group_ranks(layer.process_group)
        self.shadow = nn.BatchNorm2d(layer.num_features).double()
        self.shadow.load_state_dict(layer.state_dict())
        layer.register_forward_pre_hook(lambda m, args: self.seen.append(args[0].detach().clone()))
        if self.cumulative:
            layer.register_forward_hook(self.check_carry)

    def on_before_optimizer_step(self, trainer: L.Trainer, module: Module, optimizer: object) -> None:
        assert self.shadow is not None
        everyone: list[list[torch.Tensor]] = [[] for _ in range(2)]
        dist.all_gather_object(everyone, self.seen)
        self.shadow(torch.cat([t for inputs in everyone for t in inputs]))
        self.seen.clear()
        self.step.clear()
        layer = module.net[1]
        self.errors.append(
            max(
                (layer.running_mean - self.shadow.running_mean).abs().max().item(),
                (layer.running_var - self.shadow.running_var).abs().max().item(),
                float(abs(int(layer.num_batches_tracked) - int(self.shadow.num_batches_tracked))),
            )
        )


def fit(normalize: str) -> tuple[L.Trainer, dict[str, object]]:
    """One Trainer.fit with the callback's ``normalize``; what the checker saw."""
    module, check = Module(), Check(normalize == "cumulative")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[syncbn.lightning.SyncBatchNorm(group_size=2)],  # the plugin's subgroup path, too
        callbacks=[
            syncbn.lightning.AccumulatedStatistics(normalize),
            check,
        ],
        accumulate_grad_batches=K,
        precision="64-true",
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return trainer, {
        "errors": check.errors,
        "batches": int(module.net[1].num_batches_tracked),
        "group": check.group,
    }


def train(out: str) -> None:
    """Both fits; each rank writes ``lightning_accumulation_rank{R}.pt`` to ``out``."""
    # A later Trainer finds the processes and the process group the first one started.
    results = {}
    for normalize in ("micro-batch", "cumulative"):
        trainer, results[normalize] = fit(normalize)
    torch.save(results, os.path.join(out, f"lightning_accumulation_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    train(sys.argv[1])
