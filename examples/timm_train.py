"""Train a timm model (BatchNormAct2d layers included) with syncbn under DDP, then revert it.

Run with::

    torchrun --nproc-per-node 2 examples/timm_train.py                         # CPU, gloo
    torchrun --nproc-per-node 8 examples/timm_train.py --cuda --model efficientnet_b0

Needs ``pip install "syncbn[timm]"``.
"""

from __future__ import annotations

import argparse
import os

import timm
import torch
import torch.distributed as dist
from timm.utils import distribute_bn
from torch.nn.parallel import DistributedDataParallel as DDP

import syncbn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mobilenetv3_small_100")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    model = timm.create_model(args.model, pretrained=False, num_classes=10)
    kinds = {type(m) for m in model.modules()}
    model = syncbn.convert_sync_batchnorm(model).to(device)  # BatchNormAct2d -> SyncBatchNormAct2d
    ddp = DDP(model, device_ids=[device.index] if args.cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        x = torch.randn(8, 3, 64, 64, generator=g).to(device)
        y = torch.randint(0, 10, (8,), generator=g).to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    distribute_bn(model, dist.get_world_size(), reduce=True)  # timm's utility works as before (a no-op here)
    plain = syncbn.revert_sync_batchnorm(model)
    assert {type(m) for m in plain.modules()} == kinds  # the very same module types as before
    if dist.get_rank() == 0:
        torch.save(plain.state_dict(), "timm_model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
