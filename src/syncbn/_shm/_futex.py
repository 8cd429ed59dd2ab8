"""Shared Linux futexes on words of the segment (:mod:`syncbn._shm`), through ``ctypes``.

The kernel keys a shared futex by file and offset, so the ranks' different addresses meet.
Where the call is impossible :func:`attach` returns ``None`` (the wait then sleeps in steps).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform
import sys
from typing import Any

__all__ = ["SegmentFutex", "attach", "available"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_loaded: tuple[int, Any] | None = None
_tried = False


def _syscall() -> tuple[int, Any] | None:
    """``(SYS_futex, libc's syscall)``, looked up once per process; ``None`` where unavailable."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        pointer, u32 = ctypes.c_void_p, ctypes.c_uint32  # (number, uaddr, op, val, timeout, uaddr2, val3)
        fn.argtypes = [ctypes.c_long, pointer, ctypes.c_int, u32, pointer, pointer, u32]
    except (OSError, AttributeError, TypeError):
        return None
    _loaded = (number, fn)
    return _loaded


def available() -> bool:
    """Whether this process can make the futex system call at all (Linux, ``ctypes``, ``libc``)."""
    return _syscall() is not None


class SegmentFutex:
    """Futex wait and wake on the words of one shared mapping, which must outlive its use.

    ``number`` is ``SYS_futex`` on this architecture, ``call`` libc's ``syscall``.
    """

    def __init__(self, segment: mmap.mmap, number: int, call: Any) -> None:
        view = ctypes.c_char.from_buffer(segment)
        self._base = ctypes.addressof(view)
        del view  # the address stays valid while the mapping does; no export is kept
        self._number = number
        self._call = call
        self._timeout = _Timespec()
        self._timeout_ref = ctypes.byref(self._timeout)

    def wait(self, offset: int, expected: int, seconds: float) -> bool:
        """Sleep while the 32-bit word at byte ``offset`` holds ``expected``, at most ``seconds``.

        Returns at a wake, timeout or signal, or at once if the word differs; the caller re-reads.
        ``False`` where the kernel refused the call itself (stop using it).
        """
        seconds = max(seconds, 1e-6)
        whole = int(seconds)
        self._timeout.tv_sec = whole
        self._timeout.tv_nsec = int((seconds - whole) * 1e9)
        got = self._call(
            self._number, self._base + offset, _FUTEX_WAIT, expected & 0xFFFFFFFF, self._timeout_ref, None, 0
        )
        if got == 0:
            return True
        return ctypes.get_errno() in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)

    def wake(self, offset: int) -> bool:
        """Wake every process sleeping on the word at byte ``offset``; ``False`` if the kernel refused."""
        return bool(self._call(self._number, self._base + offset, _FUTEX_WAKE, _WAKE_ALL, None, None, 0) >= 0)


def attach(segment: mmap.mmap, probe_offset: int) -> SegmentFutex | None:
    """A :class:`SegmentFutex` on ``segment``, or ``None`` where a probe wake at ``probe_offset`` fails."""
    loaded = _syscall()
    if loaded is None:
        return None
    try:
        futex = SegmentFutex(segment, *loaded)
    except (TypeError, ValueError, BufferError):
        return None
    return futex if futex.wake(probe_offset) else None
