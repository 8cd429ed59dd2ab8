"""Command line: ``python -m syncbn <command>`` (also the ``syncbn`` console script). Each command lives in
its own module with ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

COMMANDS = {
    "demo": "Train a small conv net three ways (per-rank BatchNorm, syncbn, one process) on real digits.",
    "verify": "Check syncbn against nn.BatchNorm on the global batch on this machine's ranks and backend.",
    "bench": "Time SyncBatchNorm forward+backward against local BatchNorm, naive sync and torch.",
    "doctor": "Audit a model's batch norm before a job (and, with --live, the ranks against each other).",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return its exit code."""
    parser = argparse.ArgumentParser(
        prog="syncbn", description="Synchronized Batch Normalization for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(f"{__name__}.{args.command}")
    return int(module.run(args))
