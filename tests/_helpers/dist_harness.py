"""Run a function on W real ``torch.distributed`` ranks (gloo, CPU), bounded in time.

Each rank is a forked child that sets ``torch.set_num_threads(1)`` first, meets
its peers through a ``FileStore`` in a temporary directory (no ports), uses a
collective timeout of seconds, and writes its result (or its traceback) to a
file. The parent waits with a deadline, kills every child when one fails or
the deadline passes, and raises with the failing rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from .load import Load

COLLECTIVE_TIMEOUT_S = 30.0
MAX_STRETCH = 3.0  # how far a loaded machine may stretch a launch's deadline


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    tmp: str,
    args: tuple[Any, ...],
    finish_wait: float = 10.0,
) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    result_path = os.path.join(tmp, f"rank{rank}.pkl")
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        payload = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = (False, traceback.format_exc())
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    if payload[0]:
        # Leave only once every peer is done, so no socket closes under a collective.
        try:
            store.add("finished", 1)
            deadline = time.monotonic() + finish_wait
            while int(store.add("finished", 0)) < world_size and time.monotonic() < deadline:
                time.sleep(0.005)
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    allow_failures: bool = False,
    finish_wait: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: module-level function run on each rank after ``init_process_group``.
        world_size: number of ranks.
        *args: extra arguments (inherited through fork, need not pickle).
        timeout: seconds before every child is killed, on a quiet machine; on a loaded one,
            stretched by the CPU stretch measured meanwhile (at most :data:`MAX_STRETCH` times):
            a deadline is a guard against hangs, not a speed claim.
        allow_failures: return tracebacks (as ``("error", text)``) instead of raising.
        finish_wait: seconds a successful rank waits for its peers to finish before
            exiting (lower it in tests where a peer is expected to die).

    Returns:
        Each rank's return value, in rank order.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="syncbn-test-") as tmp:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, tmp, args, finish_wait), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        with Load() as load:  # the CPU stretch while the ranks run
            begin = time.monotonic()
            results: dict[int, tuple[bool, Any]] = {}
            failed: int | None = None
            while len(results) < world_size:
                for r in range(world_size):
                    path = os.path.join(tmp, f"rank{r}.pkl")
                    if r not in results and os.path.exists(path):
                        with open(path, "rb") as f:
                            results[r] = pickle.load(f)
                        if not results[r][0] and failed is None:
                            failed = r
                    elif r not in results and procs[r].exitcode not in (None, 0):
                        results[r] = (False, f"rank {r} died with exit code {procs[r].exitcode}")
                        failed = r if failed is None else failed
                if failed is not None and not allow_failures:
                    break
                if time.monotonic() - begin > timeout * min(load.stretch, MAX_STRETCH):
                    break
                time.sleep(0.01)
        grace = time.monotonic() + (2.0 if failed is None else 0.5)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    if failed is not None and not allow_failures:
        raise AssertionError(f"rank {failed} of {world_size} failed:\n{results[failed][1]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(
            f"ranks {missing} of {world_size} gave no result within {timeout:.0f}s (x{load.stretch:.1f}, "
            f"at most x{MAX_STRETCH:g}, for the load measured: {load!r})"
        )
    return [value if ok else ("error", value) for ok, value in (results[r] for r in range(world_size))]


_LAUNCHED: dict[tuple[Any, ...], tuple[bool, Any]] = {}


def launch_once(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """:func:`launch` once per ``(fn, world_size, args)`` for the whole session; later calls reuse it.

    A module runs many cases in one launch and its parametrised tests each read their case
    from the cached result. A failed launch is cached too: every test that reads it fails with
    the same error, without starting the ranks again.

    Args:
        fn: module-level function run on each rank (see :func:`launch`).
        world_size: number of ranks.
        *args: extra arguments; hashable, they are part of the key.
        timeout: seconds before every child is killed.

    Returns:
        Each rank's return value, in rank order.
    """
    key = (fn, world_size, *args)
    if key not in _LAUNCHED:
        try:
            _LAUNCHED[key] = (True, launch(fn, world_size, *args, timeout=timeout))
        except (AssertionError, TimeoutError) as exc:
            _LAUNCHED[key] = (False, exc)
    ok, value = _LAUNCHED[key]
    if not ok:
        raise value
    return value
