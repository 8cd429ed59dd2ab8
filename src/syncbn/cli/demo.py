"""``python -m syncbn demo``: SyncBatchNorm training a small conv net on real data.

Spawns W CPU ranks with gloo (or joins a torchrun launch) and trains a small
conv net on scikit-learn's digits (1,797 8x8 images, shipped with
scikit-learn), each rank seeing a small shard of every global batch, with
:class:`syncbn.SyncBatchNorm2d` normalising over the whole global batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..modules import SyncBatchNorm2d
from ._launch import run_ranks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=8, help="images per rank per step (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo)")


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as ``(x_train, y_train, x_test, y_test)``, images ``(N, 1, 8, 8)`` scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "the demo needs scikit-learn: pip install 'syncbn[demo]' (or pip install scikit-learn)"
        ) from exc
    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    return x[:split], y[:split], x[split:], y[split:]


def make_net(norm: Any = SyncBatchNorm2d) -> nn.Module:
    """The demo's conv net, with ``norm`` as its normalisation layer class."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        norm(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        norm(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, stride=2),
        norm(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    x_train, y_train, x_test, y_test = load_digits()
    torch.manual_seed(args.seed)
    net = make_net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    global_batch = args.batch * world_size
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(y_train), (global_batch,), generator=gen)
        mine = idx[rank * args.batch : (rank + 1) * args.batch]
        loss = nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0 and (step == 1 or step % 25 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {reported.item() / world_size:.4f}", flush=True)
    net.eval()
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print(
            f"test accuracy {accuracy:.4f} on {len(y_test)} held-out digits "
            f"({world_size} ranks x {args.batch} images per step, {time.perf_counter() - start:.1f}s)",
            flush=True,
        )


def run(args: argparse.Namespace) -> int:
    load_digits()  # fail early, in the parent, if scikit-learn is missing
    print(
        f"syncbn demo: {args.world_size} ranks ({args.backend}), SyncBatchNorm2d over the global batch "
        f"of {args.world_size} x {args.batch} digits",
        flush=True,
    )
    run_ranks(_train, args.world_size, args.backend, args)
    sys.stdout.flush()
    return 0
