"""The spin policy of the shared-memory wait (:mod:`syncbn._shm`): how long to spin before sleeping.

The wait of :class:`~syncbn._shm.SharedMemorySum` (:mod:`syncbn._shm._wait`) spins (yielding the
core) for the budget :class:`SpinPolicy` gives, then sleeps: in the kernel until the arriving rank
wakes it (a futex), or, where that is unavailable, in doubling steps up to a millisecond. The same
budget serves both: a shorter spin before the kernel sleep was measured slower (issue 29: two
ranks sharing a core hand it over best by yielding, not by a sleep and a wake).
"""

from __future__ import annotations

import os

# The wait: spin (yielding the core) for a budget, then sleep in doubling steps. See SpinPolicy.
_SPIN_S = 0.005  # the most a wait spins, when every rank of the machine has a core of its own
_SPIN_BUSY_S = 0.002  # the most it spins when this machine's ranks outnumber its cores
_SPIN_MIN_S = 0.001  # what it spins at least, and all it spins once waits outlast the cap
_SPIN_TYPICAL_TIMES = 4  # the budget, in typical waits


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class SpinPolicy:
    """How long a wait spins before it sleeps, from the cores and from recent waits.

    Spinning (with ``sched_yield``, so a runnable peer on the same core gets it) answers fastest;
    but a spinning rank keeps its core busy, so the scheduler cannot move a waiting peer rank
    onto it, and where this machine's ranks outnumber its cores that peer is one the wait waits
    for. The wait spins four typical waits (a moving average of the last ones), at least
    :data:`_SPIN_MIN_S` and at most a cap: :data:`_SPIN_S` when every rank has a core of its
    own, :data:`_SPIN_BUSY_S` when the ranks outnumber the cores this process may use
    (``os.sched_getaffinity``); once waits typically outlast the cap (a peer far behind, still
    computing) it spins only :data:`_SPIN_MIN_S` and then sleeps, freeing the core. The floor
    keeps the common short wait answered by the spin (a sleep's wake-up costs tens of
    microseconds more than a yield); the load of other processes is left to ``sched_yield``.
    ``fixed=True`` is the earlier policy (always :data:`_SPIN_S`), kept for the benchmark's
    comparison (``benchmarks/speed/hierarchical.py``).

    Args:
        ranks: ranks of the group on this machine.
        fixed: always spin :data:`_SPIN_S`.
    """

    def __init__(self, ranks: int, fixed: bool = False) -> None:
        self.ranks = ranks
        self.fixed = fixed
        self.typical = 0.0
        self.cap = _SPIN_BUSY_S if ranks > _cores() else _SPIN_S

    def budget(self, now: float) -> float:
        """Seconds to spin in the wait that starts at ``now`` (``time.monotonic()``)."""
        if self.fixed:
            return _SPIN_S
        if self.typical > self.cap:
            return _SPIN_MIN_S
        return min(self.cap, max(_SPIN_MIN_S, _SPIN_TYPICAL_TIMES * self.typical))

    def record(self, waited: float) -> None:
        """Note how long a wait took."""
        self.typical += 0.2 * (waited - self.typical)
