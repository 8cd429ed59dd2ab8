"""How loaded this machine is while a test runs, and the wall-clock margins that follow from it.

A test that checks a bound ("the error comes at the bound, not later"; "every process exits within
seconds of its error") needs an allowance for work done after the bound: raising, tearing a group
down, an interpreter exiting. On a quiet machine that work takes ``work_s`` seconds; on a machine
with more runnable processes than cores it takes longer, in proportion to how little CPU each
process gets. :class:`Load` measures that while the test runs, from a thread in the test process:

* ``stretch``: the wall time of short busy slices over their CPU time (1.0 on an idle core; about
  3 where three runnable processes share each core), or the load average per core where that is
  more: how much slower CPU-bound work runs now;
* ``late``: the most a 5 ms sleep woke late (the scheduling delay of a process that was waiting).

``margin(work_s)`` is then ``work_s * stretch + late``: the allowance for ``work_s`` seconds of
quiet-machine work done under the measured load. Tests state ``work_s`` next to the configured
bound (both in seconds) and, where it says more, an ordering that load cannot break ("before the
process group's own timeout"). Speed claims are benchmarks' business, not tests'.

Example::

    with Load() as load:
        results = launch(...)
    assert waited < BOUND + load.margin(2.0), load
"""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType

__all__ = ["Load", "loadavg"]

_TICK_S = 0.005  # the probe sleep
_SLICE_S = 0.002  # CPU time of one busy slice
_EVERY_S = 0.05  # one busy slice per this much wall time (a few percent of a core)


def _one_minute(fields: str) -> float:
    """The 1-minute load average of :func:`loadavg`'s text (0.0 where unreadable)."""
    try:
        return float(fields.split()[0])
    except (IndexError, ValueError):
        return 0.0


def loadavg() -> str:
    """``/proc/loadavg``'s first three fields ("" where unreadable), for messages."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


class Load:
    """Measure the scheduling delay and CPU stretch from ``__enter__`` to ``__exit__`` (or now).

    Read ``stretch``, ``late`` and :meth:`margin` inside or after the ``with`` block.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._wall = 0.0  # busy slices' wall time, summed
        self._cpu = 0.0  # their CPU time (this thread's), summed
        self._late = 0.0
        self._thread: threading.Thread | None = None
        self._loadavg = ""

    def __enter__(self) -> Load:
        self._loadavg = loadavg()
        self._slice()  # one measurement at least, even for a block that ends at once
        self._thread = threading.Thread(target=self._watch, name="tests-load-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _slice(self) -> None:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu0 < _SLICE_S:
            pass
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        with self._lock:
            self._wall += wall
            self._cpu += cpu

    def _watch(self) -> None:
        next_slice = time.perf_counter() + _EVERY_S
        while not self._stop.is_set():
            asked = time.perf_counter()
            time.sleep(_TICK_S)
            woke = time.perf_counter()
            with self._lock:
                self._late = max(self._late, woke - asked - _TICK_S)
            if woke >= next_slice:
                self._slice()
                next_slice = time.perf_counter() + _EVERY_S

    @property
    def stretch(self) -> float:
        """Wall over CPU time of the busy slices so far, or the runnable processes per core (the
        1-minute load average, at the start or now, over the cores) where that is more: a short
        slice after a sleep is scheduled first, so the slices alone read a busy machine as idle
        (1.22 measured while 4 busy loops and the suite shared 2 cores, load average 7.8). At least 1.0."""
        with self._lock:
            measured = self._wall / self._cpu if self._cpu > 0 else 1.0
        per_core = max(_one_minute(self._loadavg), _one_minute(loadavg())) / (os.cpu_count() or 1)
        return max(1.0, measured, per_core)

    @property
    def late(self) -> float:
        """The most a probe sleep woke late so far, in seconds."""
        with self._lock:
            return self._late

    def margin(self, work_s: float) -> float:
        """Seconds to allow for ``work_s`` seconds of quiet-machine work under the load measured."""
        return work_s * self.stretch + self.late

    def __repr__(self) -> str:
        return (
            f"Load(stretch={self.stretch:.2f}, late={self.late * 1e3:.0f} ms, "
            f"loadavg at start {self._loadavg}, now {loadavg()})"
        )
