"""Handing the segment's descriptor to peers over an abstract unix socket (:mod:`syncbn._shm`).

The fallback where ``/proc/<pid>/fd/<n>`` is refused: ``SCM_RIGHTS`` to same-user (or root)
peers only, while the set-up lasts; the socket has no path. See docs/internals/transports.md.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

__all__ = ["Server", "receive"]

_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid


class Server:
    """Hands ``fd`` to each same-user peer that connects to the abstract socket ``name`` (no NUL).

    Raises ``OSError`` when the socket cannot be made.
    """

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
            except TimeoutError:
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


def receive(name: str, timeout: float = 2.0) -> int | None:
    """The descriptor that the :class:`Server` ``name`` hands out, or ``None``."""
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
