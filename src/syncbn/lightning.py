"""The Lightning plugin (:mod:`syncbn.integrations.lightning`) by its documented name, ``syncbn.lightning``.

Importing it imports Lightning; ``import syncbn`` alone never does.
"""

from __future__ import annotations

from .integrations.lightning import AccumulatedStatistics, SyncBatchNorm

__all__ = ["AccumulatedStatistics", "SyncBatchNorm"]
