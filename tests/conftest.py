"""Fixtures shared by the whole suite.

Helpers that are not tests live in the ``_helpers`` package beside this file (rank launcher,
float64 references, shared models, skip marks); ``tests/`` is on ``sys.path`` under pytest, so
test files import ``from _helpers.dist_harness import launch``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

# Inductor compiles in this process, not in a pool of compile workers: the suite forks ranks
# from processes that may have compiled before (a test file's single-process case, or an earlier
# file on the same xdist worker), and a forked child that finds the parent's pool hangs in it
# (seen on torch 2.15). Set before torch's inductor reads its configuration.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One intra-op thread in the test processes, as in the forked ranks (dist_harness): on the loaded
# 2-core machine OpenMP's idle threads spin, and test_single_process.py took 40 s of CPU for 11 s
# of work. Set before torch starts OpenMP; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402

import pytest  # noqa: E402

import syncbn  # noqa: E402
from syncbn import parallel  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_syncbn_settings() -> Iterator[None]:
    """Give every test the settings the environment gives (autouse: torn down after monkeypatch).

    A test that calls ``syncbn.set_timeout`` or ``syncbn.set_debug`` in this process leaves no
    trace for the next one; forked ranks inherit the settings of the test that launched them.
    """
    yield
    syncbn.set_timeout("default")
    syncbn.set_debug(None)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches() -> None:
    """Each test file starts with torch.compile's caches empty (autouse, per file).

    An xdist worker runs several files in one process; the compiled frames that one file leaves
    count against the recompile limit (8) of the next file's compiled layers (the same code
    objects, other models), which then fail for a reason that is not theirs.
    """
    dynamo = sys.modules.get("torch._dynamo")  # (never imported here for a file that does not compile)
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture
def short_replica_timeout() -> Iterator[float]:
    """DataParallel replicas wait 1 s for each other (the default is minutes): a missing one fails fast."""
    old = parallel.set_replica_timeout(1.0)
    yield 1.0
    parallel.set_replica_timeout(old)
