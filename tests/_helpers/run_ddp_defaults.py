"""The most common script shape: torchrun, DDP with default arguments, convert_sync_batchnorm.

Run as ``torchrun --standalone --nproc-per-node 2 run_ddp_defaults.py``: gloo ranks on CPU, the
process group's default timeout, ``DistributedDataParallel(model)`` with nothing else passed (so
DDP broadcasts buffers at every forward), a few training steps. Each rank writes
``rank<N>.json`` in the working directory: the finding of ``syncbn.groups.step_bound`` and its
running mean.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import json

import torch
import torch.distributed as dist
from torch import nn

import syncbn


def main() -> None:
    # torchrun starts each worker in a session of its own: the test's kill of torchrun's session
    # would not reach a hung worker, so a worker bounds its own life (stacks to stderr, exit 1).
    faulthandler.dump_traceback_later(180, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    model = syncbn.convert_sync_batchnorm(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        loss = nn.functional.cross_entropy(ddp(x), y)  # the user's line
        opt.zero_grad()
        loss.backward()
        opt.step()
    finding = syncbn.groups.step_bound(ddp)
    running = model[1].running_mean.tolist()
    with open(f"rank{rank}.json", "w") as f:
        json.dump(
            {"finding": dataclasses.asdict(finding), "outwaited": finding.outwaited, "running_mean": running},
            f,
        )
    # DDP before the group: a Reducer that outlives destroy_process_group() destroys the gloo group
    # itself, with the GIL held, while a gloo worker thread may wait for the GIL (a deadlock seen on
    # torch 2.13 in about 1 of 4 runs; destroy_process_group() releases the GIL).
    del ddp, opt, loss
    gc.collect()  # DDP's module holds reference cycles
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
