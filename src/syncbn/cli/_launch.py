"""Start W local ranks that meet through a file (no ports), or join torchrun's (docs/internals/cli.md)."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import groups
from . import _args

__all__ = [
    "add_launch_arguments",
    "launch_plan",
    "launched_by_torchrun",
    "is_main_process",
    "default_backend",
    "rank_device",
    "run_ranks",
    "describe_transport",
    "gather",
    "group_size_error",
]

DEFAULT_TIMEOUT_S = 120.0


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or similar) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def is_main_process() -> bool:
    """Whether this process should print and write files: the parent, or rank 0 under a launcher."""
    return not launched_by_torchrun() or int(os.environ["RANK"]) == 0


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def add_launch_arguments(
    parser: argparse.ArgumentParser,
    device_help: str,
    world_size: int | None = 2,
    world_size_help: str = "ranks to spawn, at least 1 (default 2; ignored under torchrun)",
    group_size_help: str | None = None,
) -> None:
    """``--world-size`` (default ``world_size``), ``--device``, ``--backend``, maybe ``--group-size``."""
    parser.add_argument("--world-size", type=_args.integer(1), default=world_size, help=world_size_help)
    if group_size_help is not None:
        parser.add_argument("--group-size", type=_args.group_size, metavar="K", help=group_size_help)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help=device_help)
    parser.add_argument(
        "--backend",
        type=_args.backend,
        default=None,
        help="torch.distributed backend built into this torch: gloo, nccl, ... (default: by device)",
    )


def launch_plan(command: str, args: argparse.Namespace) -> tuple[int, str] | str:
    """``(world size, backend)`` of a command's run, or why it cannot run (its usage error)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"syncbn {command}: --device cuda, but torch.cuda.is_available() is False"
    world_size = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.world_size
    visible = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and not launched_by_torchrun() and world_size > visible:
        return f"syncbn {command}: {world_size} ranks need {world_size} GPUs, {visible} visible"
    error = group_size_error(command, world_size, getattr(args, "group_size", None))
    return error or (world_size, args.backend or default_backend(args.device))


def rank_device(device: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) for ``cuda``, else ``device``."""
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def _destroy() -> None:
    """``destroy_process_group()`` after a pause: a deadlock in torch < 2.8 (docs/internals/cli.md)."""
    time.sleep(0.05)
    dist.destroy_process_group()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    tmp: str,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        _destroy()
    if rank == 0:
        with open(os.path.join(tmp, "result.pkl"), "wb") as f:
            pickle.dump(result, f)


def run_ranks(
    fn: Callable[..., Any], world_size: int, backend: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank; rank 0's result (under torchrun: this rank's).

    ``fn`` must be module-level, ``args`` and the result must pickle; ``timeout_s`` bounds each
    collective's wait. Raises ``torch.multiprocessing.ProcessRaisedException`` when a rank raised.
    """
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        try:
            return fn(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            _destroy()
    fork_ok = sys.platform.startswith("linux") and backend != "nccl" and not torch.cuda.is_initialized()
    with tempfile.TemporaryDirectory(prefix="syncbn-") as tmp:
        mp.start_processes(
            _worker,
            args=(fn, world_size, backend, tmp, timeout_s, args),
            nprocs=world_size,
            start_method="fork" if fork_ok else "spawn",
        )
        with open(os.path.join(tmp, "result.pkl"), "rb") as f:
            return pickle.load(f)


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (collective); ``[value]`` without a group."""
    if not dist.is_initialized():
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def group_size_error(command: str, world_size: int, group_size: int | str | None) -> str | None:
    """Why ``--group-size`` cannot split ``world_size`` ranks (a usage error), or ``None``."""
    if not isinstance(group_size, int) or world_size % group_size == 0:
        return None
    return (
        f"syncbn {command}: --group-size must divide the world size {world_size} "
        f"(got group size {group_size})"
    )


def describe_transport(process_group: Any, device: torch.device | None = None) -> str:
    """How syncbn's collectives over ``process_group`` travel, in words (known after its first one)."""
    group = groups.resolve(process_group)
    if group is None:
        return "no collective (a group of one rank is plain BatchNorm)"
    backend = dist.get_backend(process_group)
    if isinstance(group, groups.ProcessGroupSum) and (device is None or device.type == "cpu"):
        if group.uses_shared_memory:
            return "shared memory (same machine)"
        if group.hierarchical:
            return f"shared memory within each machine, the {backend} process group between machines"
    return f"the {backend} process group"
