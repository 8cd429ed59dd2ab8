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
        "| shape (per rank) | local BN | 2xAR (gloo) | 2xAR (shm) | syncbn | alone | syncbn-pg | naive"
        " | syncbn / local BN | alone / local BN | syncbn / floor"
        " | syncbn / shm floor | syncbn-pg / (local+AR) | syncbn / naive |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    methods = ("local", "2xAR", "2xAR-shm", "syncbn", "alone", "syncbn-pg", "naive")
    ratio_names = (
        "syncbn_over_local",
        "alone_over_local",
        "syncbn_over_floor",
        "syncbn_over_own_floor",
        "syncbn_pg_over_interleaved_floor",
        "syncbn_over_naive",
    )
    for i, rec in enumerate(runs[0]["results"]):
        recs = [run["results"][i] for run in runs]
        ms = {k: _med([r[kind].get(k) for r in recs]) for k in methods}
        ratio = {k: _med([r[ratio_key].get(k) for r in recs]) for k in ratio_names}
        shape = "x".join(str(d) for d in rec["shape"])
        cells = [_fmt(ms[k]) for k in methods] + [f"**{_fmt(ratio[k])}**" for k in ratio_names]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def e2e_line(runs: list[Any]) -> str:
    """One line per model: the median over runs of the slowest-rank medians, and the ratios."""
    per_model: dict[str, list[Any]] = {}
    for run in runs:
        for model, rec in run.get("results", {"resnet": run}).items():  # older files: one model
            per_model.setdefault(model, []).append(rec)
    lines = []
    for model, recs in per_model.items():
        plain = _med([r["median_ms"]["plain"] for r in recs])
        sync = _med([r["median_ms"]["syncbn"] for r in recs])
        ratio = _med([r["syncbn_over_plain"] for r in recs])
        each = ", ".join(f"{r['syncbn_over_plain']:.3f}" for r in recs)
        line = (
            f"{model}: plain BatchNorm2d {_fmt(plain, '.1f')} ms, syncbn {_fmt(sync, '.1f')} ms per step:"
            f" **{_fmt(ratio, '.3f')}x** (runs: {each})"
        )
        pg = [r["syncbn_pg_over_plain"] for r in recs if "syncbn_pg_over_plain" in r]
        if pg:
            line += f"; syncbn on gloo (shared memory off) **{_fmt(_med(pg), '.3f')}x**"
        lines.append(line)
    return "\n\n".join(lines)


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
