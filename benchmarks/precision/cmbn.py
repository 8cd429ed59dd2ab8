"""Gradient accumulation with small micro-batches: BatchNorm vs SyncBatchNorm vs SyncBatchNorm + CmBN.

An MLP (64-64-BN-ReLU-64-BN-ReLU-10) on scikit-learn's ``load_digits`` (1,797 8x8 images, no
download), trained with DDP on 2 gloo ranks, per-rank micro-batch 2, k = 4 micro-batches per
optimizer step (``no_sync`` for the first 3; the loss divided by k), SGD with momentum; test
accuracy in eval mode (running statistics), mean over seeds. Every variant runs each step inside
``syncbn.accumulation`` (one exact running update per step), so only the normalisation differs:

* ``bn``: ``nn.BatchNorm1d``: each micro-batch with its rank's 2 values per channel;
* ``syncbn``: ``syncbn.SyncBatchNorm1d``: each micro-batch with both ranks' 4;
* ``cmbn``: the same layers, ``normalize="cumulative"``: micro-batch t with micro-batches 1..t
  of both ranks (4, 8, 12, 16 values).

Two data orders, as ``renorm_small_batch.py``: ``iid`` (shuffled) and ``non-iid`` (each rank's
micro-batch holds two images of one class, so a micro-batch's statistics are biased).

    python benchmarks/precision/cmbn.py [--steps 200] [--seeds 3]
"""

from __future__ import annotations

import argparse
from typing import Any

from renorm_small_batch import _data, run_two_ranks  # the same data, orders and 2-rank harness

LAYERS = ("bn", "syncbn", "cmbn")
K = 4  # micro-batches per optimizer step
PER_RANK = 2  # samples per rank and micro-batch


def _model(kind: str) -> Any:
    import torch
    from torch import nn

    import syncbn

    def norm(c: int) -> nn.Module:
        return nn.BatchNorm1d(c) if kind == "bn" else syncbn.SyncBatchNorm1d(c)

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), norm(64), nn.ReLU(), nn.Linear(64, 64), norm(64), nn.ReLU(), nn.Linear(64, 10)
    )


def _micro_batches(y: Any, order: str, count: int, rank: int, seed: int) -> list[Any]:
    """This rank's ``count`` micro-batches of indices (the same draw on both ranks, then its share)."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + 7)
    by_class = [torch.nonzero(y == c).flatten() for c in range(10)]
    out = []
    for _ in range(count):
        if order == "iid":
            idx = torch.randint(len(y), (2 * PER_RANK,), generator=g)[PER_RANK * rank : PER_RANK * (rank + 1)]
        else:
            classes = torch.randperm(10, generator=g)[:2]
            pool = by_class[int(classes[rank])]
            idx = pool[torch.randint(len(pool), (PER_RANK,), generator=g)]
        out.append(idx)
    return out


def _train(rank: int, kind: str, order: str, steps: int, seed: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import syncbn

    xtr, ytr, xte, yte = _data()
    torch.manual_seed(seed)
    model = _model(kind)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    micro = _micro_batches(ytr, order, steps * K, rank, seed)
    block = syncbn.accumulation(ddp, normalize="cumulative" if kind == "cmbn" else "micro-batch")
    for step in range(steps):
        with block:
            for t in range(K):
                idx = micro[step * K + t]
                if t < K - 1:
                    with ddp.no_sync():
                        (F.cross_entropy(ddp(xtr[idx]), ytr[idx]) / K).backward()
                else:
                    (F.cross_entropy(ddp(xtr[idx]), ytr[idx]) / K).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (k micro-batches each)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    headline = (
        f"test accuracy after {args.steps} steps of k={K} micro-batches, per-rank micro-batch "
        f"{PER_RANK} on 2 ranks, {args.seeds} seeds"
    )
    run_two_ranks(_train, args.steps, args.seeds, LAYERS, headline)


if __name__ == "__main__":
    main()
