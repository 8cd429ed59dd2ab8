"""Start W local ranks, or join the ones a launcher (torchrun) started."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or similar) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, backend: str, store_path: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, backend: str, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on every rank.

    Under torchrun, this process is one rank: join the launcher's group and call
    ``fn`` once. Otherwise spawn ``world_size`` local processes that meet through
    a ``FileStore`` in a temporary directory (no ports).
    """
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timedelta(seconds=120))
        try:
            fn(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="syncbn-") as tmp:
        mp.spawn(_worker, args=(fn, world_size, backend, os.path.join(tmp, "store"), args), nprocs=world_size)
