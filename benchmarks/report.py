"""Markdown tables for RESULTS.md from one or more ``benchmarks/run.py`` output folders.

With several folders (repeated runs), every number is the median over the runs.

    python benchmarks/report.py benchmarks/results/run1 benchmarks/results/run2 ...
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any


def _load(folders: list[str], name: str) -> list[Any]:
    out = []
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as fh:
                out.append(json.load(fh))
    return out


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def layers_table(runs: list[Any], kind: str = "median_ms") -> str:
    ratio_key = "ratios" if kind == "median_ms" else "cpu_ratios"
    lines = [
        "| shape (per rank) | local BN | 2xAR | floor | syncbn | naive | syncbn/floor | syncbn/naive |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rec in enumerate(runs[0]["results"]):
        recs = [run["results"][i] for run in runs]
        ms = {k: _med([r[kind].get(k) for r in recs]) for k in ("local", "2xAR", "syncbn", "naive")}
        floor = _med([r[ratio_key]["floor_ms"] for r in recs])
        over_floor = _med([r[ratio_key]["syncbn_over_floor"] for r in recs])
        over_naive = _med([r[ratio_key]["syncbn_over_naive"] for r in recs])
        shape = "x".join(str(d) for d in rec["shape"])
        lines.append(
            f"| {shape} | {_fmt(ms['local'])} | {_fmt(ms['2xAR'])} | {_fmt(floor)} | {_fmt(ms['syncbn'])} |"
            f" {_fmt(ms['naive'])} | **{_fmt(over_floor)}** | **{_fmt(over_naive)}** |"
        )
    return "\n".join(lines)


def e2e_line(runs: list[Any]) -> str:
    plain = _med([r["median_ms"]["plain"] for r in runs])
    sync = _med([r["median_ms"]["syncbn"] for r in runs])
    ratio = _med([r["syncbn_over_plain"] for r in runs])
    each = ", ".join(f"{r['syncbn_over_plain']:.3f}" for r in runs)
    return (
        f"plain BatchNorm2d {_fmt(plain, '.1f')} ms, syncbn {_fmt(sync, '.1f')} ms per step:"
        f" **{_fmt(ratio, '.3f')}x** (median of runs: {each})"
    )


def main(folders: list[str]) -> int:
    layers = _load(folders, "layers.json")
    if layers:
        print(
            f"### Per layer, wall clock ({len(layers)} run(s); median of runs of slowest-rank medians, ms)\n"
        )
        print(layers_table(layers))
        print("\n### Per layer, thread CPU time (same runs)\n")
        print(layers_table(layers, "cpu_median_ms"))
        loads = [run["machine"].get("load_average") for run in layers]
        print(f"\nload average at the end of each run: {loads}")
    e2e = _load(folders, "e2e.json")
    if e2e:
        print("\n### End to end\n")
        print(e2e_line(e2e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
