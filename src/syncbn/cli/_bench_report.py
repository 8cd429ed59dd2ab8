"""Reporting of ``syncbn bench``: the headline ratios and the plain-text table."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table", "ratio", "ratios"]


def ratio(ms: dict[str, float] | None, num: str, den: str) -> float | None:
    return ms[num] / ms[den] if ms and num in ms and den in ms else None


def ratios(ms: dict[str, float]) -> dict[str, float | None]:
    """The headline ratios from one shape's medians (``None`` where a method did not run)."""
    floor = ms["local"] + ms.get("2xAR", 0.0)
    own_floor = ms["local"] + ms["2xAR-shm"] if "2xAR-shm" in ms else None
    return {
        "floor_ms": floor,
        "syncbn_over_local": ms["syncbn"] / ms["local"],
        "alone_over_local": ratio(ms, "alone", "local"),
        "syncbn_over_floor": ms["syncbn"] / floor,
        "own_floor_ms": own_floor,
        "syncbn_over_own_floor": ms["syncbn"] / own_floor if own_floor else None,
        "syncbn_over_interleaved_floor": ratio(ms, "syncbn", "local+AR"),
        "syncbn_pg_over_interleaved_floor": ratio(ms, "syncbn-pg", "local+AR"),
        "syncbn_over_naive": ratio(ms, "syncbn", "naive"),
        "syncbn_over_torch": ratio(ms, "syncbn", "torch"),
        "naive_over_local": ratio(ms, "naive", "local"),
    }


def format_table(records: list[dict[str, Any]], kind: str = "median_ms") -> str:
    """A plain-text table of slowest-rank medians (ms) and ratios.

    ``kind`` is ``"median_ms"`` (wall clock) or ``"cpu_median_ms"`` (thread CPU time).
    """
    ratio_key = "ratios" if kind == "median_ms" else "cpu_ratios"
    head = (
        f"{'shape':>16} {'s/local':>7} {'a/local':>7} {'local':>7} {'2xAR':>6} {'2xAR-shm':>8}"
        f" {'local+AR':>8} {'syncbn':>7} {'alone':>7} {'sync-pg':>7} {'naive':>7} {'torch':>7}"
        f" {'s/floor':>7} {'s/floor-shm':>11}"
        f" {'pg/l+AR':>7} {'s/naive':>7} {'s/torch':>7}"
    )
    lines = [head, "-" * len(head)]

    def cell(value: float | None, width: int, fmt: str) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    for rec in records:
        ms, r = rec[kind], rec[ratio_key]
        shape = "x".join(str(d) for d in rec["shape"])
        lines.append(
            f"{shape:>16} {r['syncbn_over_local']:>7.3f} {cell(r.get('alone_over_local'), 7, '.3f')}"
            f" {ms['local']:>7.3f} {ms.get('2xAR', 0.0):>6.3f}"
            f" {cell(ms.get('2xAR-shm'), 8, '.3f')} {cell(ms.get('local+AR'), 8, '.3f')}"
            f" {ms['syncbn']:>7.3f} {cell(ms.get('alone'), 7, '.3f')} {cell(ms.get('syncbn-pg'), 7, '.3f')}"
            f" {cell(ms.get('naive'), 7, '.3f')} {cell(ms.get('torch'), 7, '.3f')}"
            f" {r['syncbn_over_floor']:>7.3f} {cell(r.get('syncbn_over_own_floor'), 11, '.3f')}"
            f" {cell(r.get('syncbn_pg_over_interleaved_floor'), 7, '.3f')}"
            f" {cell(r['syncbn_over_naive'], 7, '.3f')} {cell(r['syncbn_over_torch'], 7, '.3f')}"
        )
        if rec.get("error"):
            lines.append(f"    note: {rec['error']}")
    return "\n".join(lines)
