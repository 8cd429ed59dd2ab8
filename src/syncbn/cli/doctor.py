"""``python -m syncbn doctor MODULE:FACTORY``: audit a model's batch norm before a job. Per normalisation
layer: what conversion makes of it, what it sends per step, what a ``group_size`` gives; with ``--live``, the
ranks against each other. Exit code 0: no problem; 1: problems, one line each, naming the layer and the fix;
2: a usage error. See docs/doctor.md."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.distributed.constants import default_pg_timeout

from . import _args, _doctor_live
from ._doctor_audit import audit
from ._doctor_report import ModelSpecError, build_report, finish, load_model
from ._launch import add_launch_arguments, group_size_error, launched_by_torchrun
from ._output import fail

#: torch's default timeout of a process group (``init_process_group`` without ``timeout=``).
DEFAULT_PG_TIMEOUT_S = default_pg_timeout.total_seconds()


def _shape(text: str) -> list[int]:
    try:
        dims = [int(d) for d in text.replace("x", ",").split(",")]
    except ValueError:
        dims = []
    if len(dims) < 2 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected N,C[,...]: at least 2 positive ints (got {text!r})")
    return dims


def _kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object, e.g. '{{\"num_classes\": 10}}' (got {text!r})"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODULE:FACTORY", help="the model's factory, e.g. torchvision.models:resnet50"
    )
    parser.add_argument(
        "--kwargs", type=_kwargs, default={}, metavar="JSON", help="keyword arguments of FACTORY"
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        metavar="N,C,H,W",
        help="one rank's batch shape: runs one training forward to find each layer's calls and input",
    )
    parser.add_argument(
        "--batch-size",
        type=_args.integer(1),
        default=None,
        metavar="B",
        help="samples per rank for the group-size table (default: N of --input-shape)",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="also check the ranks against each other (under torchrun, or on --world-size local ranks)",
    )
    _args.add_output(
        parser,
        "report",
        DEFAULT_PG_TIMEOUT_S,
        "with --live, the process group's timeout in seconds, as the job's init_process_group "
        f"sets it (default {DEFAULT_PG_TIMEOUT_S:g}, torch's)",
    )
    parser.add_argument(
        "--broadcast-buffers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --live, whether the job's DistributedDataParallel broadcasts its buffers each step "
        "(DDP's default; forward_sync_buffers from torch 2.13)",
    )
    # Offline: the job's ranks (no default); with --live: the ranks to spawn.
    world_help = "the job's ranks (for the group-size table); with --live, ranks to spawn (default 2)"
    group_help = "the job's syncbn group_size: K consecutive ranks, or 'node' (with --live)"
    add_launch_arguments(parser, "where the model runs", None, world_help, group_help)


def run(args: argparse.Namespace) -> int:
    """Audit the model; print the report; 1 when it found a problem."""
    if args.live:
        return _doctor_live.run(args)
    world = args.world_size
    if args.group_size == "node":
        return fail("syncbn doctor: --group-size node needs --live (the machines are known only then)")
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail("syncbn doctor: --device cuda, but torch.cuda.is_available() is False")
    if launched_by_torchrun():
        return fail("syncbn doctor: launched by torchrun without --live: add --live to check the ranks")
    if world and (error := group_size_error("doctor", world, args.group_size)):
        return fail(error)
    try:
        model = load_model(args.model, args.kwargs).to(args.device)
    except ModelSpecError as exc:
        return fail(f"syncbn doctor: {exc}")
    chosen = [args.group_size] if isinstance(args.group_size, int) else [world] if world else []
    return finish(build_report(audit(model, args.input_shape), args, world, chosen), args.json)
