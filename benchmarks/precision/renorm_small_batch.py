"""Small per-rank batches: BatchNorm vs SyncBatchNorm vs SyncBatchRenorm, accuracy after training.

An MLP (64-64-BN-ReLU-64-BN-ReLU-10) on scikit-learn's ``load_digits`` (1,797 8x8 images, no
download), trained with DDP on 2 gloo ranks, per-rank batch 2 (global batch 4), SGD with
momentum; test accuracy in eval mode (running statistics), mean over seeds. Two data orders:

* ``iid``: shuffled batches;
* ``non-iid``: each rank's batch holds two images of one class (the classes of a step differ
  by rank): the batch statistics are a biased estimate of the population's.

Layers: ``bn`` (``nn.BatchNorm1d``: each rank's 2 values per channel), ``syncbn``
(``syncbn.SyncBatchNorm1d``: the global batch of 4), ``renorm`` (``syncbn.SyncBatchRenorm1d``
with the paper's warm-up: ``r_max`` 1 -> 3 and ``d_max`` 0 -> 5 over the first third of the
steps, ``r_max=1, d_max=0`` before).

    python benchmarks/precision/renorm_small_batch.py [--steps 1500] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
from datetime import timedelta
from typing import Any

LAYERS = ("bn", "syncbn", "renorm")
ORDERS = ("iid", "non-iid")


def _data() -> tuple[Any, Any, Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    cut = 1400
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def _model(kind: str) -> Any:
    import torch
    from torch import nn

    import syncbn

    def norm(c: int) -> nn.Module:
        if kind == "bn":
            return nn.BatchNorm1d(c)
        if kind == "syncbn":
            return syncbn.SyncBatchNorm1d(c)
        return syncbn.SyncBatchRenorm1d(c, r_max=1.0, d_max=0.0)

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), norm(64), nn.ReLU(), nn.Linear(64, 64), norm(64), nn.ReLU(), nn.Linear(64, 10)
    )


def _batches(y: Any, order: str, steps: int, rank: int, seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * seed + 7)
    out = []
    by_class = [torch.nonzero(y == c).flatten() for c in range(10)]
    for _ in range(steps):
        if order == "iid":
            idx = torch.randint(len(y), (4,), generator=g)[2 * rank : 2 * rank + 2]
        else:
            classes = torch.randperm(10, generator=g)[:2]
            pool = by_class[int(classes[rank])]
            idx = pool[torch.randint(len(pool), (2,), generator=g)]
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
    warm = max(1, steps // 3)
    for step, idx in enumerate(_batches(ytr, order, steps, rank, seed)):
        if kind == "renorm":
            t = min(1.0, step / warm)
            for m in model.modules():
                if isinstance(m, syncbn.SyncBatchRenorm):
                    m.r_max, m.d_max = 1.0 + 2.0 * t, 5.0 * t
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def _rank(rank: int, tmp: str, train: Any, steps: int, seeds: int, kinds: Any, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 2), rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    results = {
        f"{order}/{kind}": [train(rank, kind, order, steps, s) for s in range(seeds)]
        for order in ORDERS
        for kind in kinds
    }
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(train: Any, steps: int, seeds: int, kinds: Any, headline: str) -> None:
    """``train(rank, kind, order, steps, seed) -> accuracy`` on 2 forked gloo ranks, every order,
    kind and seed; prints the table (``headline`` first) and the results as JSON."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        args = (tmp, train, steps, seeds, kinds, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(2)]
        for p in procs:
            p.start()
        results = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    print(headline)
    print(f"{'order':8} {'layer':7} {'mean':>6}  per seed")
    for key, accs in results.items():
        order, kind = key.split("/")
        print(f"{order:8} {kind:7} {sum(accs) / len(accs):6.3f}  {' '.join(f'{a:.3f}' for a in accs)}")
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    headline = f"test accuracy after {args.steps} steps, per-rank batch 2 on 2 ranks, {args.seeds} seeds"
    run_two_ranks(_train, args.steps, args.seeds, LAYERS, headline)


if __name__ == "__main__":
    main()
