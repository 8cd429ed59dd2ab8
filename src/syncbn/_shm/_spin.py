"""How long the shared-memory wait spins before it sleeps. See docs/internals/transports.md."""

from __future__ import annotations

import os

_SPIN_S = 0.005  # the most a wait spins, when every rank of the machine has a core of its own
_SPIN_BUSY_S = 0.002  # the most it spins when this machine's ranks outnumber its cores
_SPIN_MIN_S = 0.001  # what it spins at least, and all it spins once waits outlast the cap
_SPIN_TYPICAL_TIMES = 4  # the budget, in typical waits


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SpinPolicy:
    """How long a wait spins before it sleeps, from the cores and from recent waits."""

    def __init__(self, ranks: int) -> None:
        self.typical = 0.0
        self.cap = _SPIN_BUSY_S if ranks > _cores() else _SPIN_S

    def budget(self, now: float) -> float:
        """Seconds to spin in the wait that starts at ``now`` (``time.monotonic()``)."""
        if self.typical > self.cap:
            return _SPIN_MIN_S
        return min(self.cap, max(_SPIN_MIN_S, _SPIN_TYPICAL_TIMES * self.typical))

    def record(self, waited: float) -> None:
        """Note how long a wait took."""
        self.typical += 0.2 * (waited - self.typical)
