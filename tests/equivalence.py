"""Equivalence cases: syncbn on W ranks vs ``nn.BatchNorm`` on the global batch in float64.

The cases and the comparison live in the package (:mod:`syncbn.cli._checks`), so
that ``python -m syncbn verify`` runs on a user's machine exactly what the test
suite runs here. This module re-exports them for the tests.
"""

from __future__ import annotations

from syncbn.cli._checks import EXACT_KEYS, Case, run_case, standard_cases, tolerance

__all__ = ["EXACT_KEYS", "Case", "run_case", "standard_cases", "tolerance"]
