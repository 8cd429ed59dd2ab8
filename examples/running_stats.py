"""Exact BatchNorm statistics: merge per-rank running stats, or recompute them over the data set.

Trains with plain (per-rank) BatchNorm, then makes every rank's statistics the
exact merge over ranks (``sync_running_stats``), then replaces them by the
population statistics of the whole training set (``recompute_running_stats``).
Run with::

    torchrun --nproc-per-node 2 examples/running_stats.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import syncbn


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 12, 12))  # materialise the lazy layer
    ddp = DDP(model, broadcast_buffers=False)  # per-rank BatchNorm: the ranks' statistics drift apart
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    shard = [torch.randn(16, 3, 12, 12, generator=g) + rank for _ in range(10)]  # this rank's data
    for x in shard:
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()

    bn = model[1]
    print(f"rank {rank}: running_var[:3] per rank  {bn.running_var[:3].tolist()}")
    syncbn.sync_running_stats(model)  # one all_reduce: within- plus between-rank variance
    print(f"rank {rank}: after sync_running_stats  {bn.running_var[:3].tolist()}")
    syncbn.recompute_running_stats(model, shard)  # exact statistics of all ranks' data
    print(f"rank {rank}: after recompute           {bn.running_var[:3].tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
