"""The spin policy of the shared-memory wait (:mod:`syncbn._shm`): how long to spin before sleeping.

The wait of :class:`~syncbn._shm.SharedMemorySum` spins (yielding the core) for the budget
:class:`SpinPolicy` gives, then sleeps in doubling steps up to a millisecond.
"""

from __future__ import annotations

import os

# The wait: spin (yielding the core) for a budget, then sleep in doubling steps. See SpinPolicy.
_SPIN_S = 0.005  # the most a wait spins, when every rank has a core of its own
_SPIN_MIN_S = 5e-5  # what it spins when waits are long or the cores are oversubscribed
_RECHECK_CORES_S = 2.0


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class SpinPolicy:
    """How long a wait spins before it sleeps, from the cores and from recent waits.

    Spinning answers fastest, but a spinning rank holds a core; where there are more runnable
    processes than cores (ranks on this machine, or the load average, above the cores this
    process may use) that core is one a peer rank needs to arrive at all, so the wait spins
    only :data:`_SPIN_MIN_S`. Otherwise it spins up to twice the typical wait (a moving average
    of the last waits) plus :data:`_SPIN_MIN_S`, at most :data:`_SPIN_S`, and only
    :data:`_SPIN_MIN_S` once waits typically last longer than that (a peer far behind: spinning
    would not catch it). ``fixed=True`` is the earlier policy (always :data:`_SPIN_S`), kept
    for the benchmark's comparison.

    Args:
        ranks: ranks of the group on this machine.
        fixed: always spin :data:`_SPIN_S`.
    """

    def __init__(self, ranks: int, fixed: bool = False) -> None:
        self.ranks = ranks
        self.fixed = fixed
        self.typical = 2e-4
        self.oversubscribed = False
        self._checked = -1e9

    def budget(self, now: float) -> float:
        """Seconds to spin in the wait that starts at ``now`` (``time.monotonic()``)."""
        if self.fixed:
            return _SPIN_S
        if now - self._checked > _RECHECK_CORES_S:
            self._checked = now
            try:
                load = os.getloadavg()[0]
            except OSError:
                load = 0.0
            self.oversubscribed = max(float(self.ranks), load) > _cores()
        if self.oversubscribed or self.typical > _SPIN_S:
            return _SPIN_MIN_S
        return min(_SPIN_S, 2 * self.typical + _SPIN_MIN_S)

    def record(self, waited: float) -> None:
        """Note how long a wait took."""
        self.typical += 0.2 * (waited - self.typical)
