"""Process-wide settings: each an environment variable and a Python override, which wins (docs/robustness.md,
"Settings"). The environment is read at the first training call; ``set_timeout("default")`` and
``set_debug(None)`` read it again."""

from __future__ import annotations

import decimal
import math
import numbers
import os
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "set_timeout",
    "get_timeout",
    "set_debug",
    "debug_enabled",
    "set_shared_memory",
    "shared_memory_enabled",
]

#: Default bound, in seconds, on one SyncBatchNorm collective: room for a slow data loader or a
#: checkpoint write on one rank, short next to ``torch.distributed``'s 30 minutes.
DEFAULT_TIMEOUT_S = 300.0

#: The largest bound accepted, in seconds (about 31.7 years): every wait syncbn makes takes it
#: (``timedelta`` stops near 8.6e13 s, a thread's wait on Linux at ``threading.TIMEOUT_MAX``, 9.2e9 s).
MAX_TIMEOUT_S = 1e9
#: The smallest bound, in seconds: ``torch.distributed`` takes whole milliseconds and reads 0 ms as
#: "wait forever", so a positive bound below it is taken as it.
MIN_TIMEOUT_S = 1e-3

#: What ``SYNCBN_DEBUG`` and ``SYNCBN_SHM`` accept (any case; empty or unset: the default).
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_UNSET = object()
_timeout_override: object = _UNSET
_debug_override: bool | None = None
_shm_override: bool | None = None
# Resolved values, read by training calls; None until first read.
_timeout_resolved: tuple[float | None, timedelta | None, str] | None = None  # (seconds, timedelta, source)
_debug_resolved: bool | None = None


def _parse_timeout(value: object, source: str) -> float | None:
    if value is None:
        return None
    exact: Any = value  # compared exactly: "1e-400" is a positive bound, 10**400 or "1e400" a finite one
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none", "inf", "infinity", "off"):
            return None
        try:
            float(text)  # refuses what is no number ("snan" too, which Decimal takes)
            exact = decimal.Decimal(text)
        except ValueError:
            raise ValueError(f"{source}: expected a number of seconds, 0 or 'none' (got {value!r})") from None
    elif not isinstance(value, numbers.Real) or isinstance(value, bool):  # numpy scalars, Fraction are
        raise TypeError(f"{source}: expected a number of seconds or None (got {type(value).__name__})")
    if exact != exact or exact < 0:  # NaN or negative
        raise ValueError(f"{source}: expected a non-negative number of seconds (got {_shown(value)})")
    if exact == 0 or exact == math.inf:
        return None
    if exact > MAX_TIMEOUT_S:
        raise ValueError(
            f"{source}: expected at most {MAX_TIMEOUT_S:g} seconds, about 31 years (got {_shown(value)}); "
            "for no bound of syncbn's own (the process group's timeout bounds every wait) use 0 or 'none'"
        )
    return max(float(exact), MIN_TIMEOUT_S)  # a positive bound never reaches torch as 0 ms ("no timeout")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} characters)"


def _parse_switch(name: str, default: bool) -> bool:
    """Environment variable ``name`` as a switch: :data:`_TRUE`, :data:`_FALSE`, or empty (``default``)."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if not text:
        return default
    accepted = "/".join(a for pair in zip(_TRUE, _FALSE) for a in pair)
    raise ValueError(
        f"{name}: expected one of {accepted} (any case), or empty for the default "
        f"({'on' if default else 'off'}) (got {raw!r})"
    )


def set_timeout(seconds: float | None | str = "default") -> None:
    """Bound every wait of a SyncBatchNorm collective in this process.

    Overrides ``SYNCBN_TIMEOUT``. When a peer does not arrive within the bound, the waiting rank
    raises a ``RuntimeError`` naming the layer, the group, the time waited and the likely causes.

    Args:
        seconds: the bound in seconds (any real number: ``int``, ``float``, numpy scalars,
            ``Fraction``), at most ``1e9`` (about 31 years); a positive bound below ``0.001`` is
            taken as ``0.001`` (1 ms, the finest timeout ``torch.distributed`` takes: it reads 0 ms
            as "no timeout"); ``None``, ``0`` or ``inf`` (not a finite ``"1e400"``) for no bound of
            syncbn's own (the process group's timeout then bounds every wait, shared memory
            included); ``"default"`` to drop the override and use ``SYNCBN_TIMEOUT`` or the default.

    Raises:
        ValueError: a negative or NaN number, a number above ``1e9``, or a string that is not a number, here;
            the same for ``SYNCBN_TIMEOUT`` at the first training call (or :func:`get_timeout`).
        TypeError: neither a real number, a string nor ``None``.

    Example::

        >>> import syncbn
        >>> syncbn.set_timeout(60)        # fail within a minute instead of five
        >>> syncbn.get_timeout()
        60.0
        >>> syncbn.set_timeout("default")
    """
    global _timeout_override, _timeout_resolved
    default = isinstance(seconds, str) and seconds == "default"
    _timeout_override = _UNSET if default else _parse_timeout(seconds, "syncbn.set_timeout")
    _timeout_resolved = None


def get_timeout() -> float | None:
    """The bound, in seconds, on one SyncBatchNorm collective, or ``None`` for none.

    Returns:
        The value of :func:`set_timeout` if set, else ``SYNCBN_TIMEOUT`` if set, else
        :data:`DEFAULT_TIMEOUT_S`.

    Example::

        >>> import syncbn
        >>> syncbn.get_timeout()
        300.0
    """
    return (_timeout_resolved or _resolve_timeout())[0]


def _resolve_timeout() -> tuple[float | None, timedelta | None, str]:
    global _timeout_resolved
    value: float | None = _timeout_override  # type: ignore[assignment]
    source = "set_timeout"
    if _timeout_override is _UNSET:
        env = os.environ.get("SYNCBN_TIMEOUT")
        value = DEFAULT_TIMEOUT_S if env is None else _parse_timeout(env, "SYNCBN_TIMEOUT")
        source = "default" if env is None else "SYNCBN_TIMEOUT"
    _timeout_resolved = (value, None if value is None else timedelta(seconds=value), source)
    return _timeout_resolved


def timeout_source() -> str:
    """Who chose :func:`get_timeout`'s value: ``"set_timeout"``, ``"SYNCBN_TIMEOUT"`` or ``"default"``."""
    return (_timeout_resolved or _resolve_timeout())[2]


def timeout_delta() -> timedelta | None:
    """:func:`get_timeout` as a ``timedelta`` (made once, not per call)."""
    return (_timeout_resolved or _resolve_timeout())[1]


def set_debug(enabled: bool | None) -> None:
    """Turn the per-call cross-rank consistency checks on or off in this process.

    Overrides ``SYNCBN_DEBUG``. Every rank of a group must use the same setting (the checks are collectives).

    Args:
        enabled: ``True`` or ``False``; ``None`` drops the override.

    Example::

        >>> import syncbn
        >>> syncbn.set_debug(True)
        >>> syncbn.debug_enabled()
        True
        >>> syncbn.set_debug(None)
    """
    global _debug_override, _debug_resolved
    _debug_override = None if enabled is None else bool(enabled)
    _debug_resolved = None


def debug_enabled() -> bool:
    """Whether debug mode is on: :func:`set_debug`, else ``SYNCBN_DEBUG``.

    ``SYNCBN_DEBUG`` takes ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off`` (any
    case; empty or unset: off).

    Raises:
        ValueError: ``SYNCBN_DEBUG`` holds anything else (read at the first training call: on
            every rank that has it, before any state changes).

    Example::

        >>> import syncbn
        >>> syncbn.debug_enabled()
        False
    """
    global _debug_resolved
    if _debug_resolved is None:
        _debug_resolved = _parse_switch("SYNCBN_DEBUG", False) if _debug_override is None else _debug_override
    return _debug_resolved


def set_shared_memory(enabled: bool | None) -> None:
    """Allow or forbid the same-machine shared-memory path for CPU collectives.

    By default, when every rank of a group runs on one machine (x86-64 Linux), CPU collectives go through a
    shared-memory segment instead of the process group's transport: about 40 us instead of 1-2 ms for gloo.
    Set it on every rank before a group's first training call; the ranks agree when the group is first used
    (any rank saying no means the process group for all), and the choice then holds for that group.

    Args:
        enabled: ``True``/``False`` to override, ``None`` to follow ``SYNCBN_SHM`` again:
            ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off`` (any case; empty or
            unset: on). Any other value of ``SYNCBN_SHM`` raises a ``ValueError`` at the group's
            first CPU collective, before it sends anything.

    Example::

        >>> import syncbn
        >>> syncbn.set_shared_memory(False)   # e.g. to compare with gloo
        >>> syncbn.shared_memory_enabled()
        False
        >>> syncbn.set_shared_memory(None)
    """
    global _shm_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_shared_memory: expected True, False or None (got {type(enabled).__name__})")
    _shm_override = enabled


def shared_memory_enabled() -> bool:
    """Whether this rank allows the shared-memory path (:func:`set_shared_memory`, else ``SYNCBN_SHM``).

    Raises:
        ValueError: ``SYNCBN_SHM`` is neither empty nor one of ``1``/``0``, ``true``/``false``,
            ``yes``/``no``, ``on``/``off`` (any case).
    """
    return _parse_switch("SYNCBN_SHM", True) if _shm_override is None else _shm_override
