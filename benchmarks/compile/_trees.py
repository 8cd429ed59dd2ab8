"""The command line of a benchmark that measures one process, or compares syncbn source trees.

Used by ``op_call.py`` and ``loopback_step.py``. Without ``--src`` the script measures in this
process and prints the result (``--json``: one JSON line). With ``--src`` (repeatable) it runs
itself once per tree, the trees taking turns ``--repeat`` times, each run a fresh process with
``PYTHONPATH`` set to the tree and ``--json`` added, and takes per tree the median of each
measurement over its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Callable


def measure_or_compare(
    script: str,
    doc: str | None,
    counts: dict[str, int],
    repeat: int,
    measure: Callable[..., dict[str, float]],
    line: str,
) -> tuple[argparse.Namespace, dict[str, dict[str, float]] | None]:
    """Parse the command line, then measure here (printed; ``None``) or compare the trees.

    Args:
        script: the benchmark's own path (``__file__``), run once per tree.
        doc: its docstring (the first line describes it in ``--help``).
        counts: its integer options and their defaults, handed to ``measure`` in this order.
        repeat: the default of ``--repeat``.
        measure: one process's measurement: a name -> value dict.
        line: the format of one printed measurement, ``line.format(name, value)``.

    Returns:
        the parsed arguments, and per tree (``--src``) the median of each measurement over its
        runs, or ``None`` where this process measured and printed.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    for name, default in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--src", action="append", default=[], help="a syncbn source tree (repeatable)")
    parser.add_argument("--repeat", type=int, default=repeat, help="runs per --src, taking turns")
    parser.add_argument("--json", action="store_true", help="print one JSON line (one process)")
    args = parser.parse_args()
    if not args.src:
        result = measure(*(getattr(args, name) for name in counts))
        for text in [json.dumps(result)] if args.json else [line.format(k, v) for k, v in result.items()]:
            print(text)
        return args, None
    forwarded = [item for name in counts for item in (f"--{name}", str(getattr(args, name)))]
    runs: dict[str, list[dict[str, float]]] = {src: [] for src in args.src}
    for _ in range(args.repeat):
        for src in args.src:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            cmd = [sys.executable, script, *forwarded, "--json"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[src].append(json.loads(out.strip().splitlines()[-1]))
    medians = {src: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for src, rs in runs.items()}
    return args, medians
