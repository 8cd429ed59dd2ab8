"""Reporting of ``syncbn bench``: the ratios, the layer table, the targets table (docs/internals/cli.md)."""

from __future__ import annotations

import math
import os
from typing import Any

from ._output import format_table as aligned

__all__ = [
    "LAYER_COLUMNS",
    "MANY_FAULTS",
    "TARGETS",
    "allocator_note",
    "format_table",
    "format_targets",
    "load_average",
    "ratio",
    "ratios",
    "targets",
]


def _name(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def ratio(ms: dict[str, float] | None, num: str, den: str) -> float | None:
    return ms[num] / ms[den] if ms and num in ms and den in ms else None


def ratios(ms: dict[str, float]) -> dict[str, float | None]:
    """The headline ratios from one shape's medians (``None`` where a method did not run)."""
    floor = ms["local"] + ms.get("2xAR", 0.0)
    return {
        "floor_ms": floor,
        "syncbn_over_local": ms["syncbn"] / ms["local"],
        "alone_over_local": ratio(ms, "alone", "local"),
        "syncbn_over_floor": ms["syncbn"] / floor,
        "syncbn_over_naive": ratio(ms, "syncbn", "naive"),
        "syncbn_over_torch": ratio(ms, "syncbn", "torch"),
        "naive_over_local": ratio(ms, "naive", "local"),
    }


#: The layer table's columns: header, then where its value is (``ms``: the medians, ``r``: the ratios).
LAYER_COLUMNS = [
    ("s/local", "r", "syncbn_over_local"),
    ("a/local", "r", "alone_over_local"),
    *((name, "ms", name) for name in ("local", "2xAR", "syncbn", "alone", "naive", "torch")),
    ("s/floor", "r", "syncbn_over_floor"),
    ("s/naive", "r", "syncbn_over_naive"),
    ("s/torch", "r", "syncbn_over_torch"),
]


def format_table(
    records: list[dict[str, Any]],
    kind: str = "median_ms",
    columns: list[tuple[str, str, str]] = LAYER_COLUMNS,
) -> str:
    """The slowest-rank medians (ms) and ratios of ``kind``: ``"median_ms"`` (wall) or ``"cpu_median_ms"``."""
    rows, notes = [], []
    for rec in records:
        found = {"ms": rec[kind], "r": rec["ratios" if kind == "median_ms" else "cpu_ratios"]}
        cells = [found[where].get(key) for _, where, key in columns]
        shape = _name(rec["shape"])
        rows.append([shape, *("-" if v is None else f"{v:.3f}" for v in cells)])
        notes += [f"    note ({shape}): {rec['error']}"] if rec.get("error") else []
    headers = ["shape", *(header for header, _, _ in columns)]
    return "\n".join([aligned(headers, rows, [True] * len(headers)), *notes])


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``None`` where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


#: values per rank from which a layer counts as large
LARGE = 256 * 1024

#: key -> (quantity, target: the ratio must be at most this, what the run needs to measure it)
TARGETS: dict[str, tuple[str, float, str]] = {
    "eager_step": ("eager DDP step, narrow net: syncbn / nn.BatchNorm2d", 1.10, "--nets deep, W > 1"),
    "floor_deep": ("eager DDP step, narrow net: syncbn / fused floor", 1.05, "--nets deep, W > 1"),
    "floor_wide": ("eager DDP step, wide net: syncbn / fused floor", 1.0, "--nets wide, W > 1"),
    "floor_resnet": ("eager DDP step, ResNet-style net: syncbn / fused floor", 1.0, "--nets resnet, W > 1"),
    "compiled_narrow": ("compiled DDP step, narrow net: syncbn / nn.BatchNorm2d", 1.10, "--compiled, W > 1"),
    "compiled_wide": ("compiled DDP step, wide net: syncbn / nn.BatchNorm2d", 1.05, "--compiled, W > 1"),
    "large_layers": ("eager layer fwd+bwd, >= 256K values: syncbn / local BN, worst", 1.0, "a large shape"),
    "small_layers": ("eager layer fwd+bwd, < 256K values: syncbn / local BN, worst", 2.0, "a small shape"),
    "small_alone": ("the same, no peer (alone: syncbn's own work) / local BN, worst", 1.3, "a small shape"),
    "torch_step": ("eager DDP step, narrow net: syncbn / torch.nn.SyncBatchNorm", 0.8, "CUDA with NCCL"),
}


def _worst(
    records: list[dict[str, Any]], large: bool, key: str = "syncbn_over_local"
) -> tuple[float | None, str]:
    picked = [r for r in records if (math.prod(r["shape"]) >= LARGE) == large and r["ratios"].get(key)]
    if not picked:
        return None, ""
    return max(r["ratios"][key] for r in picked), ", ".join(_shape_detail(r) for r in picked)


def _floor(ms: dict[str, float] | None) -> tuple[float | None, str]:
    """A net's syncbn / fused floor, with both against nn.BatchNorm2d as the detail."""
    value = ratio(ms, "syncbn", "fused")
    if value is None or ms is None:
        return None, ""
    return value, f"x plain: syncbn {ms['syncbn'] / ms['plain']:.3f}, floor {ms['fused'] / ms['plain']:.3f}"


def _shape_detail(record: dict[str, Any]) -> str:
    """``SHAPE RATIO``, with syncbn's own work against local BN (``alone``) where it was measured."""
    text = _name(record["shape"]) + f" {record['ratios']['syncbn_over_local']:.2f}"
    alone = record["ratios"].get("alone_over_local")
    return text if alone is None else f"{text} (alone {alone:.2f})"


#: minor page faults per call from which ``syncbn bench`` points at the allocator (256 KiB in 4 KiB pages)
MANY_FAULTS = 64


def allocator_note(records: list[dict[str, Any]]) -> str | None:
    """A note naming the worst shape when layer calls page-faulted memory in again, else ``None``."""
    counts = [
        (max(faults.get("local", 0.0), faults.get("syncbn", 0.0)), _name(record["shape"]))
        for record in records
        if (faults := record.get("faults_per_call") or {})
    ]
    worst = max(counts, key=lambda count: count[0], default=None)  # the first of equal ones
    if worst is None or worst[0] < MANY_FAULTS:
        return None
    return (
        f"page faults: up to {worst[0]:.0f} per layer call ({worst[1]}): the allocator gives freed "
        "activation memory back to the kernel and each step faults it in again, and a synchronised "
        "layer also waits for a peer's faults. On Linux with glibc, MALLOC_TRIM_THRESHOLD_=4000000000 "
        "MALLOC_MMAP_THRESHOLD_=268435456 in the training processes' environment keeps it (this command "
        "run with them shows the difference; see the performance page of the docs)."
    )


def targets(
    records: list[dict[str, Any]],
    e2e: dict[str, dict[str, float]] | None,
    compiled: dict[str, dict[str, float]] | None,
) -> list[dict[str, Any]]:
    """One row per target from ``bench_layers``' records and the steps' slowest-rank medians (ms).

    ``e2e`` and ``compiled``: per net, the step per variant (``fused``: the fused floor).
    """
    compiled, e2e = compiled or {}, e2e or {}
    deep = e2e.get("deep")
    measured: dict[str, tuple[float | None, str]] = {
        "eager_step": (ratio(deep, "syncbn", "plain"), ""),
        "floor_deep": _floor(deep),
        "floor_wide": _floor(e2e.get("wide")),
        "floor_resnet": _floor(e2e.get("resnet")),
        "compiled_narrow": (ratio(compiled.get("deep"), "syncbn", "plain"), ""),
        "compiled_wide": (ratio(compiled.get("wide"), "syncbn", "plain"), ""),
        "large_layers": _worst(records, True),
        "small_layers": _worst(records, False),
        "small_alone": _worst(records, False, "alone_over_local"),
        "torch_step": (ratio(deep, "syncbn", "torch"), ""),
    }
    rows = []
    for key, (quantity, target, needs) in TARGETS.items():
        value, detail = measured[key]
        met = None if value is None else value <= target
        row = {"key": key, "quantity": quantity, "measured": value, "target": target, "met": met}
        rows.append({**row, "detail": detail, "needs": needs})
    return rows


def _load(load: list[float] | None) -> str:
    return "unknown" if load is None else " ".join(f"{v:.2f}" for v in load)


def format_targets(
    rows: list[dict[str, Any]], load_start: list[float] | None, load_end: list[float] | None
) -> str:
    """The targets as a text table, then the load averages (1, 5, 15 min) at start and end."""
    cells = []
    for row in rows:
        goal = f"<= {row['target']:.2f}"
        if row["measured"] is None:
            cells.append([row["quantity"], "-", goal, "not run", f"needs {row['needs']}"])
            continue
        met = "met" if row["met"] else "NOT met"
        cells.append([row["quantity"], f"{row['measured']:.3f}", goal, met, row["detail"]])
    table = aligned(["target", "ratio", "goal", "", "detail"], cells, [False, True, True])
    return f"{table}\nload average (1, 5, 15 min): {_load(load_start)} at start, {_load(load_end)} at end"
