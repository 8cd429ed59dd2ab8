"""Fixtures shared by the whole suite.

Helpers that are not tests live in the ``_helpers`` package beside this file (rank launcher,
float64 references, shared models, skip marks); ``tests/`` is on ``sys.path`` under pytest, so
test files import ``from _helpers.dist_harness import launch``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import syncbn
from syncbn import parallel


@pytest.fixture(autouse=True)
def _fresh_syncbn_settings() -> Iterator[None]:
    """Give every test the settings the environment gives (autouse: torn down after monkeypatch).

    A test that calls ``syncbn.set_timeout`` or ``syncbn.set_debug`` in this process leaves no
    trace for the next one; forked ranks inherit the settings of the test that launched them.
    """
    yield
    syncbn.set_timeout("default")
    syncbn.set_debug(None)


@pytest.fixture
def short_replica_timeout() -> Iterator[float]:
    """DataParallel replicas wait 1 s for each other (the default is minutes): a missing one fails fast."""
    old = parallel.set_replica_timeout(1.0)
    yield 1.0
    parallel.set_replica_timeout(old)
