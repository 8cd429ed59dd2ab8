"""The wait of the shared-memory exchange: spin, then sleep on a futex of the segment (else in steps),
bounded, dead peers checked every 0.1 s. See docs/internals/transports.md#the-wait."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
import time
from typing import Any

from ._spin import SpinPolicy

__all__ = ["WITHDRAWN", "SegmentFutex", "WaitFailure", "Waiter", "alive", "attach", "available"]

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
    """Futex wait and wake on the words of one shared mapping, which must outlive its use."""

    def __init__(self, segment: mmap.mmap, number: int, call: Any) -> None:
        view = ctypes.c_char.from_buffer(segment)
        self._base = ctypes.addressof(view)
        del view  # the address stays valid while the mapping does; no export is kept
        self._number = number
        self._call = call
        self._timeout = _Timespec()
        self._timeout_ref = ctypes.byref(self._timeout)

    def wait(self, offset: int, expected: int, seconds: float) -> bool:
        """Sleep while the 32-bit word at byte ``offset`` holds ``expected``, at most ``seconds`` (the
        caller re-reads); ``False`` where the kernel refused the call itself (stop using it)."""
        seconds = max(seconds, 1e-6)
        whole = int(seconds)
        self._timeout.tv_sec = whole
        self._timeout.tv_nsec = int((seconds - whole) * 1e9)
        got = self._call(
            self._number, self._base + offset, _FUTEX_WAIT, expected & 0xFFFFFFFF, self._timeout_ref, None, 0
        )
        return got == 0 or ctypes.get_errno() in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)

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


WITHDRAWN = -1
_MAX_SLEEP_S = 0.001
_FIRST_SLEEP_S = 2e-5
_LIVENESS_EVERY_S = 0.1
_HINT_WORD = 2  # the sleep hint's word in a rank's header line (0: the flag, 1: why it withdrew)
_HINT_RANK_BITS = 16


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class WaitFailure(Exception):
    """Why a wait ended without every rank: ``kind`` (withdrawn, timeout, dead) and the ``ranks``."""

    def __init__(self, kind: str, ranks: list[int], waited: float) -> None:
        super().__init__(kind)
        self.kind = kind
        self.ranks = ranks
        self.waited = waited


class Waiter:
    """The wait of one rank of a segment (``flags``: int64 words; ``futex`` ``None``: sleep in steps),
    and the wake it owes the ranks that sleep on it."""

    def __init__(
        self, flags: Any, flag_index: list[int], rank: int, pids: list[int], futex: SegmentFutex | None
    ) -> None:
        self._flags = flags
        self._index = flag_index
        self._size = len(flag_index)
        self._pids = pids
        self.spin = SpinPolicy(self._size)
        self.futex = futex
        self.in_kernel = futex is not None  # whether this rank's wait sleeps in the kernel (else in steps)
        self._own_offset = flag_index[rank] * 8
        self._own_hint = flag_index[rank] + _HINT_WORD
        self._peer_hints = [i + _HINT_WORD for r, i in enumerate(flag_index) if r != rank]
        self._me = rank + 1  # how a sleeper's hint names this rank
        self._woke = False

    def arrived(self) -> None:
        """After this rank raised its flag: wake the ranks whose sleep hint names it."""
        self._woke = False
        if self.futex is None:
            return
        flags, me = self._flags, self._me
        for i in self._peer_hints:
            if flags[i] & 0xFFFF == me:
                self._woke = True
                self.futex.wake(self._own_offset)
                return

    def recheck(self, seq: int) -> None:
        """Later in the call: wake a rank asleep on this one in round ``seq`` that :meth:`arrived` missed."""
        if self.futex is None or self._woke:
            return
        flags, want = self._flags, (seq << _HINT_RANK_BITS) | self._me
        for i in self._peer_hints:
            if flags[i] == want:
                self._woke = True
                self.futex.wake(self._own_offset)
                return

    def withdrew(self) -> None:
        """After this rank's flag turned -1: wake every sleeping rank, whichever flag it sleeps on."""
        if self.futex is not None:
            for i in self._index:
                self.futex.wake(i * 8)

    def wait(self, seq: int, timeout: float) -> None:
        """Return once every rank's flag has reached ``seq``; else raise :class:`WaitFailure`."""
        flags, index, size = self._flags, self._index, self._size
        pending = 0  # ranks below this one have arrived
        while pending < size and flags[index[pending]] >= seq:
            pending += 1
        if pending == size:  # the common case of the last rank to arrive: no clock, no policy
            self.spin.record(0.0)
            return
        start = time.monotonic()
        spin = self.spin.budget(start)
        next_check = start + _LIVENESS_EVERY_S
        step = _FIRST_SLEEP_S
        while True:
            while pending < size and flags[index[pending]] >= seq:
                pending += 1
            if pending == size:
                self.spin.record(time.monotonic() - start)
                return
            if flags[index[pending]] == WITHDRAWN:
                raise WaitFailure("withdrawn", [pending], time.monotonic() - start)
            now = time.monotonic()
            if now - start < spin:
                os.sched_yield()
                continue
            if now - start >= timeout:
                raise WaitFailure("timeout", [pending], now - start)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                dead = [r for r in range(size) if flags[index[r]] < seq and not alive(self._pids[r])]
                if dead:
                    raise WaitFailure("dead", dead, now - start)
            for r in range(size):  # any rank that withdrew (not only the one slept on): fail now
                if flags[index[r]] == WITHDRAWN:
                    raise WaitFailure("withdrawn", [r], now - start)
            if self.in_kernel:
                self._sleep(seq, pending, min(next_check, start + timeout) - now)
            else:
                time.sleep(step)
                step = min(step * 2, _MAX_SLEEP_S)

    def _sleep(self, seq: int, pending: int, seconds: float) -> None:
        """Sleep in the kernel on rank ``pending``'s flag word, its hint published, at most ``seconds``."""
        flags, word = self._flags, self._index[pending]
        assert self.futex is not None
        flags[self._own_hint] = (seq << _HINT_RANK_BITS) | (pending + 1)
        try:
            value = flags[word]  # read again after the hint: an arrival before it is seen here
            if WITHDRAWN < value < seq and not self.futex.wait(word * 8, value, seconds):
                self.in_kernel = False  # the kernel refused the wait: steps from now on (wakes still owed)
        finally:
            flags[self._own_hint] = 0
