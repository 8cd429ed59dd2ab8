"""Probe (not in CI): which message does each survivor give when a peer is killed at an instant of a step?

Three ranks on shared memory train the model of ``tests/test_dead_peer.py``; rank 2 is killed
with ``SIGKILL`` at each named instant (the test's list) ``--runs`` times, and the survivors'
``CollectiveError`` messages are counted by kind: "died" (the dead rank named, with the ranks
it names), "gave up" (a peer's withdrawal, with its reason), "timeout", or the text itself.
Run it under load (e.g. 4 busy processes) to look for instants that only a loaded machine hits.

Usage::

    python benchmarks/robustness/dead_peer_probe.py [--instants random-1,asleep-in-the-wait] [--runs 20]

Recorded in ``docs/robustness.md`` ("What each failure looks like").
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import test_dead_peer as case  # noqa: E402
from _helpers.dist_harness import launch  # noqa: E402


def kind(message: str) -> str:
    """The kind of a survivor's message, in a few words."""
    if "died" in message:
        return "died: " + ", ".join(re.findall(r"rank\(s\) \[[0-9, ]+\]", message))
    found = re.search(r"gave up on this collective \(([^)]*)\)", message)
    if found:
        return "gave up: " + found.group(1)
    if "not every rank arrived" in message:
        return "timeout"
    return message[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--instants", default=",".join(case.INSTANTS), help="comma-separated (the test's names)"
    )
    parser.add_argument("--runs", type=int, default=10, help="launches per instant")
    args = parser.parse_args()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for instant in args.instants.split(","):
        if instant not in case.INSTANTS:
            parser.error(f"unknown instant {instant!r}; expected one of {case.INSTANTS}")
        for run in range(args.runs):
            seed = run * len(case.INSTANTS) + case.INSTANTS.index(instant)  # random-* differ per run
            results = launch(
                case._train, case.WORLD, instant, seed, timeout=120, allow_failures=True, finish_wait=0.5
            )
            for result in results[: case.VICTIM]:
                text = result["msg"] if isinstance(result, dict) else "harness: " + result[1][-160:]
                counts[instant, kind(text)] += 1
    print("| instant | survivors' message | count |\n|---|---|---|")
    for (instant, what), n in sorted(counts.items()):
        print(f"| {instant} | {what} | {n} |")


if __name__ == "__main__":
    main()
