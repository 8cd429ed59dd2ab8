"""Same-machine all_reduce over shared memory, for CPU tensors.

When every rank of a process group runs on one machine, a small CPU
``all_reduce`` does not need a transport at all: each rank writes its vector
into its own slot of a shared-memory segment, raises its sequence flag, waits
until every flag has reached the same sequence number and sums the slots. On a
2-vCPU machine that takes about 40 us, against 1.5-2 ms for gloo's TCP
all_reduce of the same 1,025 float64 values (four thread hand-offs per call);
SyncBatchNorm makes two per layer and step.

The segment (an anonymous memfd, see the set-up below)::

    header     token (int64) | one 64-byte line per rank: its round number (-1: withdrawn),
               why it withdrew, its sleep hint (the round and the rank it sleeps on)
    buffer 0   world_size slots: a 64-byte metadata line, then 64 KiB of data
    buffer 1   the same

    metadata   round | present | layer<<32 | kind<<16 | sequence | count<<16 | frame
               | CRC-32 of the data | values in this round | (unused)

The metadata line carries the frame header of :mod:`syncbn.groups` (the
caller's identity, phase, dtype, call sequence, total size, frame index) and a
participation flag (0: a rank that only shadows the call, DDP ``Join``). After
the wait every rank reads every rank's line: the participating ranks must have
sent the same header, else every rank raises a mismatch error at once (the
segment stays usable). Every rank copies the slots to private memory and checks
each participating slot's CRC-32 there before summing the copy: a torn or
foreign write into a slot is an error, never a silent wrong sum. A vector
longer than a slot takes several rounds, each with its frame index: the same
path whatever the size, so ranks can never end up on different transports.

A rank that gives up (timeout, a dead peer, a bad checksum) *withdraws*: it sets
its flag to -1, and a peer that arrives late sees that and fails too, instead of
completing the call with the data left behind (there remains a window of
microseconds in which the late rank read every flag just before the
withdrawal). With ``SYNCBN_TIMEOUT=none`` the bound is the process group's own
timeout.

Round ``k`` uses buffer ``k % 2``. A rank writes buffer ``k % 2`` for call ``k``
only after every rank has raised its flag to ``k - 1``, which each did after
finishing call ``k - 2``, the previous user of that buffer: two buffers are
enough. Every rank sums the slots in the same order with the same kernel, so
every rank gets the same bits.

Ordering: the slot is written before the flag and read after the flags, and
x86-64 keeps stores in order and loads in order (TSO); this module is used on
x86-64 Linux only. The wait (:mod:`._wait`) spins (yielding the core) for a
while, then sleeps in the kernel on the flag word of the rank it waits for (a
shared futex, :mod:`._futex`), woken by that rank as it arrives: past the spin, a
waiting rank leaves its core and wakes within tens of microseconds of the
arrival (the stepped sleep before it: up to a millisecond). Where futexes cannot
be used (chosen once per segment) it sleeps in steps growing from 20 us to 1 ms
instead. How long it spins adapts (:class:`~syncbn._shm._spin.SpinPolicy`):
four typical recent waits, at least 1 ms, at most 5 ms when every rank has a
core of its own and 2 ms when the machine's ranks outnumber its cores, and only
1 ms once waits typically last longer than that (a peer still computing, which
a spinning rank's core could serve). It gives up after the syncbn timeout,
within about 0.1 s of a peer process that has not arrived no longer existing,
and at once when a peer withdraws.

Set-up is collective: :func:`connect` runs on every rank at the same point (the
first CPU collective of a group) and agrees, over the process group, whether the
shared-memory path is usable everywhere; if not, every rank keeps using the
process group. Rank 0 creates the segment only after the first exchange has
shown every rank present, as an anonymous ``memfd`` (no path in ``/dev/shm`` or
anywhere): the peers open it through ``/proc/<pid of rank 0>/fd/<n>`` (same user
or root, same PID namespace) and check its size and a 48-bit token rank 0 wrote
into it (where ``/proc`` is refused, rank 0 hands the descriptor over an
abstract unix socket instead, :mod:`._handoff`); rank 0 closes its descriptor
once every rank has mapped it. The memory lives exactly as long as a descriptor
or a mapping of it: a kill at any instant, of any rank or of all, leaves nothing
behind. A peer that cannot open it either way (another PID and network
namespace, as in a container; another user) or finds another object there makes
every rank keep the process group. Files ``syncbn-<pid>-*`` that earlier
versions left in ``/dev/shm`` are removed at set-up once their process is gone.
A segment belongs to the process that mapped it: :mod:`syncbn.groups` refuses a
child forked afterwards. ``SYNCBN_SHM=0`` (or :func:`syncbn.set_shared_memory`)
turns it off.

The per-call exchange (the layout, :class:`SharedMemorySum`) is in ``_exchange``; this module
holds the set-up and the lifecycle of segments.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import sys
import zlib
from typing import Callable

import torch
from torch import Tensor

from . import _handoff
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
    """A 48-bit key of this machine as the ranks can share memory on it, exact in float64.

    The host name, the boot id (one per running kernel) and the PID namespace: two containers
    that share a host name on one machine but not their process table cannot reach each
    other's segments (``/proc/<pid>`` names another process there), so they count as two
    machines. The set-up still proves every pairing by mapping the segment (:func:`_attach`).
    """
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    try:
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pid_ns = ""
    text = f"{socket.gethostname()}|{boot}|{pid_ns}".encode()
    return float((zlib.crc32(text) << 16) | (zlib.adler32(text) & 0xFFFF))


def remove_stale(directory: str = "/dev/shm") -> list[str]:
    """Unlink every ``syncbn-<pid>-*`` file whose creating process no longer exists.

    Segments have no path since they became memfds; this clears what earlier versions of
    syncbn, killed inside their set-up, left in ``/dev/shm``.

    Args:
        directory: where segments live.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "syncbn" or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or _alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        _unlink(path)
        removed.append(path)
    return removed


def connect(
    rank: int, world_size: int, enabled: bool, exchange: Callable[[Tensor], Tensor]
) -> SharedMemorySum | None:
    """Set up the shared-memory path for one group, collectively; ``None`` where unusable.

    Every rank of the group must call this at the same point. Three rounds of
    ``exchange`` (a summing all_reduce over the process group) agree on it:
    every rank is present, wants it and runs on the same machine; then rank 0
    creates the segment (an anonymous memfd) and sends its token and descriptor
    number; then every rank mapped it through ``/proc/<pid of rank 0>/fd/<n>``
    and can see every peer's process, and rank 0 closes its descriptor. Any
    failure anywhere means ``None`` on every rank.

    Args:
        rank: this rank's index in the group.
        world_size: number of ranks.
        enabled: this rank's setting (:func:`syncbn.set_shared_memory`); any rank
            saying no turns the path off for all.
        exchange: sums a float64 tensor over the group, in place, returning it.

    Returns:
        The connected :class:`SharedMemorySum`, or ``None``.
    """
    want = enabled and supported()
    fd = -1  # rank 0: the memfd, closed once every rank has mapped it (or failed)
    server: _handoff.Server | None = None  # rank 0: hands the memfd out where /proc is refused
    segment: mmap.mmap | None = None
    size = _segment_size(world_size)
    try:
        table = torch.zeros(world_size, 3, dtype=torch.float64)
        table[rank] = torch.tensor(
            [1.0 if want else 0.0, _host_key(), float(os.getpid())], dtype=torch.float64
        )
        table = exchange(table)
        if not (bool((table[:, 0] == 1).all()) and bool((table[:, 1] == table[0, 1]).all())):
            return None
        pids = [int(p) for p in table[:, 2].tolist()]
        # Every rank is here: only now does rank 0 create the segment (and clear old leftovers).
        offer = torch.zeros(3, dtype=torch.float64)
        if rank == 0:
            remove_stale()
            token = secrets.randbits(48) or 1
            made = _create(f"syncbn-{os.getpid()}-{token:012x}", size, token)
            if made is not None:
                fd, segment = made
                offer[0], offer[1], offer[2] = 1.0, float(token), float(fd)
                try:  # the fallback to /proc: the descriptor over an abstract socket
                    server = _handoff.Server(_socket_name(pids[0], token), fd)
                except OSError:
                    server = None
        offer = exchange(offer)
        if offer[0].item() != 1:
            return None
        token = int(offer[1].item())
        ok = True
        if rank != 0:
            segment = _attach(pids[0], int(offer[2].item()), size, token, _socket_name(pids[0], token))
            ok = segment is not None
        ok = ok and all(_alive(pid) for pid in pids)
        agreed = exchange(torch.tensor([0.0 if ok else 1.0], dtype=torch.float64))
        if server is not None:
            server.close()
            server = None
        if fd >= 0:
            os.close(fd)
            fd = -1
        if agreed.item() != 0 or segment is None:
            return None
        shared = SharedMemorySum(segment, rank, world_size, pids)
        segment = None
        return shared
    finally:
        if server is not None:
            server.close()
        if segment is not None:
            segment.close()
        if fd >= 0:
            os.close(fd)


def _socket_name(pid: int, token: int) -> str:
    return f"syncbn-{pid}-{token:012x}"


def _create(name: str, size: int, token: int) -> tuple[int, mmap.mmap] | None:
    """An anonymous segment (memfd ``name``): its descriptor and its mapping, or ``None``.

    It has no path: it exists while a descriptor or a mapping of it does, so no kill at any
    instant can leave it behind.
    """
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
    _write_token(segment, token)
    return fd, segment


def _write_token(segment: mmap.mmap, token: int) -> None:
    with memoryview(segment) as raw, raw.cast("q") as words:
        words[0] = token


def _read_token(segment: mmap.mmap) -> int:
    with memoryview(segment) as raw, raw.cast("q") as words:
        return int(words[0])


def _attach(pid: int, number: int, size: int, token: int, name: str = "") -> mmap.mmap | None:
    """Map the segment that process ``pid`` holds as descriptor ``number``; ``None`` if not ours.

    ``/proc/<pid>/fd/<n>`` opens the very object the creator holds, when this process may
    read that process's descriptors (same user, or root). Where that is refused, the creator's
    abstract socket ``name`` hands the descriptor over (:mod:`._handoff`). In another PID
    namespace (a container) the number names another process or none: the size and the 48-bit
    token, written by the creator, then do not match, and the ranks keep the process group.
    """
    fd = _open_proc(pid, number)
    if fd is None and name:
        fd = _handoff.receive(name)
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
    if _read_token(segment) != token:
        segment.close()
        return None
    return segment


def _open_proc(pid: int, number: int) -> int | None:
    try:
        return os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
