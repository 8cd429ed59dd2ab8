"""Equivalence cases: syncbn on W ranks vs ``nn.BatchNorm`` on the global batch in float64.

The cases and the comparison live in the package (:mod:`syncbn.cli._checks`), so
that ``python -m syncbn verify`` runs on a user's machine exactly what the test
suite runs here. This module re-exports them for the tests.
"""

from __future__ import annotations

from typing import Any

from syncbn.cli._checks import EXACT_KEYS, Case, run_case, standard_cases, tolerance

__all__ = ["EXACT_KEYS", "Case", "run_case", "run_standard_cases", "standard_cases", "tolerance"]


def run_standard_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every standard case on this rank: its errors, or the exception text where one raised."""
    out: dict[str, Any] = {}
    for case in standard_cases(world_size):
        try:
            out[case.name] = run_case(case, rank)
        except Exception as exc:  # noqa: BLE001 - reported per case
            out[case.name] = f"{type(exc).__name__}: {exc}"
    return out
