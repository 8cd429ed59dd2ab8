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
