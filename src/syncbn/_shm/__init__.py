"""Same-machine all_reduce over a shared memfd segment, for CPU tensors: set-up and segment lifetime
(the per-call exchange: ``_exchange``). See docs/internals/transports.md."""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import socket
import struct
import sys
import threading
import zlib
from typing import Callable

import torch
from torch import Tensor

from ._exchange import DTYPE_CODES, SharedMemoryError, SharedMemorySum, _segment_size  # noqa: F401
from ._wait import alive as _alive

__all__ = ["SharedMemorySum", "SharedMemoryError", "connect", "supported"]


def supported() -> bool:
    """Whether this process can use the shared-memory path at all (x86-64 Linux with memfd and ``/proc``)."""
    return (
        sys.platform.startswith("linux")
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(os, "memfd_create")
        and os.path.isdir("/proc/self/fd")
    )


def _host_key() -> float:
    """A 48-bit key (exact in float64) of host name, boot id and PID namespace: each container a machine."""
    boot = pid_ns = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    with contextlib.suppress(OSError):
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    text = f"{socket.gethostname()}|{boot}|{pid_ns}".encode()
    return float((zlib.crc32(text) << 16) | (zlib.adler32(text) & 0xFFFF))


def machines(keys: list[float]) -> list[list[int]]:
    """The ranks of each machine (by first rank) from every rank's :func:`_host_key`."""
    found: dict[float, list[int]] = {}
    for rank, key in enumerate(keys):
        found.setdefault(key, []).append(rank)
    return list(found.values())


def connect(
    rank: int, world_size: int, enabled: bool, exchange: Callable[[Tensor], Tensor]
) -> SharedMemorySum | None:
    """Set up the shared-memory path for one group, collectively (``exchange`` sums a float64 tensor
    over the group); ``None`` on every rank where unusable or any rank's ``enabled`` says no."""
    want = bool(enabled) and supported()
    fd = -1  # rank 0: the memfd, closed once every rank has mapped it (or failed)
    server: _Server | None = None  # rank 0: hands the memfd out where /proc is refused
    segment: mmap.mmap | None = None
    size = _segment_size(world_size)
    try:
        table = torch.zeros(world_size, 3, dtype=torch.float64)
        table[rank] = torch.tensor([float(want), _host_key(), float(os.getpid())], dtype=torch.float64)
        table = exchange(table)
        if not (bool((table[:, 0] == 1).all()) and bool((table[:, 1] == table[0, 1]).all())):
            return None
        pids = [int(p) for p in table[:, 2].tolist()]
        # Every rank is here: only now does rank 0 create the segment.
        offer = torch.zeros(3, dtype=torch.float64)
        if rank == 0:
            token = secrets.randbits(48) or 1
            made = _create(_segment_name(os.getpid(), token), size, token)
            if made is not None:
                fd, segment = made
                offer[0], offer[1], offer[2] = 1.0, float(token), float(fd)
                with contextlib.suppress(OSError):  # the fallback to /proc: the descriptor over a socket
                    server = _Server(_segment_name(pids[0], token), fd)
        offer = exchange(offer)
        if offer[0].item() != 1:
            return None
        token = int(offer[1].item())
        if rank != 0:
            segment = _attach(pids[0], int(offer[2].item()), size, token, _segment_name(pids[0], token))
        ok = segment is not None and all(_alive(pid) for pid in pids)
        agreed = exchange(torch.tensor([0.0 if ok else 1.0], dtype=torch.float64))
        if agreed.item() != 0 or segment is None:
            return None
        shared = SharedMemorySum(segment, rank, world_size, pids)
        segment = None
        return shared
    finally:  # rank 0's descriptor and socket go once every rank has mapped the segment (or failed)
        if server is not None:
            server.close()
        if segment is not None:
            segment.close()
        if fd >= 0:
            os.close(fd)


def _segment_name(pid: int, token: int) -> str:
    """The name of the memfd and of the hand-off socket of the segment that process ``pid`` made."""
    return f"syncbn-{pid}-{token:012x}"


def _create(name: str, size: int, token: int) -> tuple[int, mmap.mmap] | None:
    """An anonymous segment (memfd ``name``, no path): its descriptor and its mapping, or ``None``."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except (OSError, AttributeError):
        return None
    try:
        # Reserve every page now: a memory cgroup that is full then fails here with ENOSPC or
        # ENOMEM, not later with SIGBUS on the first write to a missing page.
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        segment = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        return None
    struct.pack_into("q", segment, 0, token)
    return fd, segment


def _attach(pid: int, number: int, size: int, token: int, name: str = "") -> mmap.mmap | None:
    """Map the segment that process ``pid`` holds as descriptor ``number`` (through ``/proc``, else the
    socket ``name``); ``None`` unless its size and token match (another PID namespace)."""
    fd = _open_proc(pid, number)
    if fd is None and name:
        fd = _receive(name)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        segment = mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if struct.unpack_from("q", segment)[0] != token:
        segment.close()
        return None
    return segment


def _open_proc(pid: int, number: int) -> int | None:
    try:
        return os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None


# Where /proc/<pid>/fd/<n> is refused: the descriptor over an abstract unix socket (same user, or root).
_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid


class _Server:
    """Hands ``fd`` to each same-user peer connecting to the abstract socket ``name`` (else ``OSError``)."""

    def __init__(self, name: str, fd: int) -> None:
        self._fd = fd
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(64)
            self._sock.settimeout(0.05)
        except OSError:
            self._sock.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="syncbn-shm-handoff", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        me = os.getuid()
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:  # TimeoutError from Python 3.10 on; an OSError apart before
                continue
            except OSError:
                return
            with conn:
                try:
                    _, uid, _ = _CREDENTIALS.unpack(
                        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
                    )
                    if uid in (me, 0):
                        socket.send_fds(conn, [b"s"], [self._fd])
                except OSError:
                    continue

    def close(self) -> None:
        """Stop handing out the descriptor (the socket's name disappears with it)."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._sock.close()


def _receive(name: str, timeout: float = 2.0) -> int | None:
    """The descriptor that the :class:`_Server` ``name`` hands out, or ``None``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            sock.connect("\0" + name)
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    except OSError:
        return None
    for extra in fds[1:]:
        os.close(extra)
    return fds[0] if fds else None
