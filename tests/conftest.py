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

# syncbn (and with it torch) is imported by the fixtures below, not here: under xdist the
# controlling process loads this file too, runs no test, and would spend about 5 s of CPU on the
# import before it starts the workers.

# The files that take longest (seconds of test time in a quiet `-n 2` run of 925 tests on 2 cores,
# stop 47), started first: with `--dist loadfile` each xdist worker takes the next whole file in
# collection order, and a long file taken last leaves the other worker idle until it ends. The
# other files follow in their usual order. A guide, not a contract: a file missing here still runs.
HEAVY_FILES = {
    "test_compile_scale.py": 52,
    "test_bench.py": 34,
    "test_cli.py": 33,
    "test_compile.py": 32,
    "test_integrations_lightning.py": 30,
    "test_faults.py": 29,
    "test_accumulation.py": 29,
    "test_setup_faults.py": 28,
    "test_family_matrix.py": 22,
    "test_integrations_timm.py": 21,
    "test_compile_graph_input.py": 20,
    "test_quiet.py": 17,
    "test_compile_shapes.py": 17,
    "test_shared_memory.py": 16,
    "test_multihost.py": 14,
    "test_robustness.py": 14,
    "test_doctor_live.py": 12,
    "test_dead_peer.py": 11,
    "test_teardown.py": 10,
}


def pytest_configure(config: pytest.Config) -> None:
    # xdist's loadfile otherwise hands out the files with the most tests first (its default
    # --loadscope-reorder), whatever their cost: keep the order set below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest files first (``HEAVY_FILES``); a stable sort keeps each file's tests in their order."""
    items.sort(key=lambda item: -HEAVY_FILES.get(item.path.name, 0))


@pytest.fixture(autouse=True)
def _fresh_syncbn_settings() -> Iterator[None]:
    """Give every test the settings the environment gives (autouse: torn down after monkeypatch).

    A test that calls ``syncbn.set_timeout`` or ``syncbn.set_debug`` in this process leaves no
    trace for the next one; forked ranks inherit the settings of the test that launched them.
    """
    yield
    import syncbn

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
    """DataParallel replicas wait 20 s for each other (the default is minutes): a missing one fails in
    bounded time, and replicas that are merely slow on a loaded machine still meet (1 s once failed at a
    load of 12-14). A test that waits for the timeout on purpose sets a shorter one itself."""
    from syncbn import parallel

    old = parallel.set_replica_timeout(20.0)
    yield 20.0
    parallel.set_replica_timeout(old)
