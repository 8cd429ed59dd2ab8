"""Train with syncbn under DistributedDataParallel.

Run with::

    torchrun --nproc-per-node 2 examples/ddp_train.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/ddp_train.py --cuda     # GPUs, NCCL
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import syncbn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    # One line: every BatchNorm becomes a SyncBatchNorm over the default group.
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            sync = syncbn.SyncBatchNorm2d(child.num_features)
            sync.load_state_dict(child.state_dict())
            model._modules[name] = sync
    model = nn.parallel.DistributedDataParallel(model.to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    for step in range(args.steps):
        x = torch.randn(4, 3, 16, 16, device=device)
        y = torch.randint(0, 10, (4,), device=device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
