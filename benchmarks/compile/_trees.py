"""Run a benchmark script once per syncbn source tree, the trees taking turns, and collect its JSON.

Used by ``op_call.py`` and ``loopback_step.py``: each run is a fresh process with ``PYTHONPATH``
set to one tree and ``--json`` added to the script's own arguments; the script prints one JSON
object (its measurements) as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_trees(script: str, srcs: list[str], repeat: int, args: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` runs of ``script args --json`` per tree in ``srcs``, in turns: tree -> results."""
    runs: dict[str, list[dict[str, Any]]] = {src: [] for src in srcs}
    for _ in range(repeat):
        for src in srcs:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            cmd = [sys.executable, script, *args, "--json"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[src].append(json.loads(out.strip().splitlines()[-1]))
    return runs


def add_arguments(parser: Any, repeat: int) -> None:
    """The options every such script takes: ``--src`` (repeatable), ``--repeat``, ``--json``."""
    parser.add_argument("--src", action="append", default=[], help="a syncbn source tree (repeatable)")
    parser.add_argument("--repeat", type=int, default=repeat, help="runs per --src, taking turns")
    parser.add_argument("--json", action="store_true", help="print one JSON line (one process)")


def print_one(result: dict[str, Any], as_json: bool, line: str) -> None:
    """One process's result: a JSON line, or ``line.format(key, value)`` per measurement."""
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(line.format(key, value))
