"""Simulated machines for multi-host tests: Linux network namespaces joined by veth pairs.

Each *host* is a network namespace (``ip netns add``) with one veth whose other end sits on a
bridge in a hub namespace; the addresses are on a private subnet made here
(``10.231.<n>.0/24``) and only those veths carry traffic. The ranks of a host share its own
hostname and mount namespace, with ``private_shm`` its own tmpfs on ``/dev/shm``, and with
``own_pids`` its own PID namespace (a container). gloo runs over
real TCP on the veth (``GLOO_SOCKET_IFNAME``); the ranks meet through a ``FileStore`` in a
temporary directory (the file system is shared by every namespace).

Needs root and ``ip``; :func:`available` says whether this machine has them.
Names carry this process's pid, so concurrent runs never collide, and everything made is
removed on exit, on failure too (and namespaces of dead earlier runs at the next start).

Every rank is forked from the test's process (as ``tests/_helpers/dist_harness.py`` does: no second
import of torch) and enters its host's namespaces itself (``setns``, ``unshare`` through libc).
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from syncbn._shm._wait import alive  # (a zombie counts as gone)

_PREFIX = "sbn"
HERE = os.path.dirname(os.path.abspath(__file__))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def available() -> str:
    """Empty when namespaces can be made here; else why not (for ``pytest.skip``)."""
    if not sys.platform.startswith("linux"):
        return "Linux only"
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs 'ip' (iproute2)"
    if not hasattr(_libc(), "setns"):
        return "needs setns(2)"
    probe = f"{_PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", probe, check=False)
    return ""


def remove_stale() -> None:
    """Delete the namespaces of earlier runs whose process is gone (names ``sbn<pid>...``)."""
    for name in _ip("netns", "list", check=False).stdout.split():
        if not name.startswith(_PREFIX):
            continue
        rest = name[len(_PREFIX) :]
        digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]
        if digits and int(digits) != os.getpid() and not alive(int(digits)):
            _ip("netns", "del", name, check=False)


@dataclass
class Host:
    """One simulated machine."""

    index: int
    netns: str
    ifname: str  # the veth inside the host
    hub_ifname: str  # its other end, on the hub's bridge
    address: str
    hostname: str


@dataclass
class Hosts:
    """A set of simulated machines; a context manager that removes them on exit.

    Args:
        count: number of hosts.
        hostnames: each host's hostname (default ``host0``, ``host1``, ...); equal names
            simulate containers that share a hostname.
    """

    count: int
    hostnames: list[str] | None = None
    hosts: list[Host] = field(default_factory=list)
    hub: str = ""
    subnet: int = 0

    def __enter__(self) -> Hosts:
        remove_stale()
        pid = os.getpid()
        self.subnet = pid % 250 + 1
        self.hub = f"{_PREFIX}{pid}x"
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.count):
                ns = f"{_PREFIX}{pid}h{i}"
                host = Host(
                    i,
                    ns,
                    f"sbn{i}",
                    f"hub{i}",
                    f"10.231.{self.subnet}.{i + 1}",
                    (self.hostnames or [f"host{j}" for j in range(self.count)])[i],
                )
                _ip("netns", "add", ns)
                self.hosts.append(host)
                _ip("-n", ns, "link", "add", host.ifname, "type", "veth", "peer", "name", host.hub_ifname)
                _ip("-n", ns, "link", "set", host.hub_ifname, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", host.hub_ifname, "master", "br0")
                _ip("-n", self.hub, "link", "set", host.hub_ifname, "up")
                _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
                _ip("-n", ns, "link", "set", host.ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for host in self.hosts:
            _ip("netns", "del", host.netns, check=False)
        if self.hub:
            _ip("netns", "del", self.hub, check=False)
        self.hosts = []

    def link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link up or down (its end on the hub's bridge)."""
        _ip("-n", self.hub, "link", "set", self.hosts[host].hub_ifname, "up" if up else "down")

    def launch(
        self,
        fn: Callable[..., Any],
        ranks_per_host: list[int],
        *args: Any,
        private_shm: bool = False,
        own_pids: bool = False,
        exit_normally: bool = False,
        pg_timeout: float = 30.0,
    ) -> Launch:
        """Run ``fn(rank, world_size, directory, *args)`` on every rank; ranks fill hosts in order.

        Every rank is forked from this process (no second import of torch), moves into its
        host's namespaces and meets the others through a ``FileStore``.

        Args:
            fn: the rank function (module level or not: it is inherited through fork); its
                result must pickle.
            ranks_per_host: how many ranks each host runs.
            *args: more arguments for ``fn``.
            private_shm: each host gets its own tmpfs on ``/dev/shm`` (as a container).
            own_pids: each host's ranks share a PID namespace of their own (as in a container:
                they see no other host's process, so they cannot reach its memory either).
            exit_normally: after ``fn``, a rank destroys its process group and collects its
                garbage (every destructor runs, gloo's included) before it exits; the time it
                exited is in :attr:`Launch.rank_exits`.
            pg_timeout: the process group's own timeout, seconds.
        """
        directory = tempfile.mkdtemp(prefix="syncbn-netns-")
        world = sum(ranks_per_host)
        pids: list[int] = []
        first = 0
        for host, count in zip(self.hosts, ranks_per_host):
            ranks = list(range(first, first + count))
            first += count
            pid = os.fork()
            if pid == 0:  # the host's process: its namespaces, then its ranks
                code = 1
                try:
                    os.setpgid(0, 0)
                    _enter(host, private_shm, own_pids)
                    if own_pids:
                        init = os.fork()  # the PID namespace's first process (pid 1) starts the ranks
                        if init == 0:
                            _mount(b"proc", b"/proc", b"proc", 0, None)
                            _start_ranks(fn, ranks, world, directory, args, exit_normally, pg_timeout)
                            os._exit(0)
                        os.waitpid(init, 0)
                    else:
                        _start_ranks(fn, ranks, world, directory, args, exit_normally, pg_timeout)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        return Launch(directory, pids, world)


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: bytes, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
    _check(_libc().mount(source, target, fstype, ctypes.c_ulong(flags), data), f"mount {target!r}")


_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x20000000, 0x40000000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000


def _enter(host: Host, private_shm: bool, own_pids: bool) -> None:
    """Move this (single-threaded, just forked) process into ``host``: network, hostname, mounts."""
    libc = _libc()
    fd = os.open(f"/var/run/netns/{host.netns}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS | (_CLONE_NEWPID if own_pids else 0)), "unshare")
    _mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)  # nothing mounted here leaks out
    socket.sethostname(host.hostname)
    if private_shm:
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=64m")
    os.environ["GLOO_SOCKET_IFNAME"] = host.ifname


def _start_ranks(
    fn: Callable[..., Any],
    ranks: list[int],
    world: int,
    directory: str,
    args: tuple[Any, ...],
    exit_normally: bool,
    pg_timeout: float,
) -> None:
    """Fork one process per rank, wait for them all and note when each exited."""
    children = {}
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            _rank(fn, rank, world, directory, args, exit_normally, pg_timeout)
        children[pid] = rank
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, -1)
        if rank >= 0:
            with open(os.path.join(directory, f"rank{rank}.exit"), "w") as f:
                f.write(f"{time.time()} {status}")


def _rank(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    directory: str,
    args: tuple[Any, ...],
    exit_normally: bool,
    pg_timeout: float,
) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    result_path = os.path.join(directory, f"rank{rank}.pkl")
    store = None
    try:
        store = dist.FileStore(os.path.join(directory, "store"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
        )
        payload = (True, fn(rank, world, directory, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = (False, traceback.format_exc())
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    if exit_normally:
        # As a script ends: destroy the group, let every destructor run (gloo's too), then exit.
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
    elif payload[0] and store is not None:
        try:  # leave only once every peer is done, so no socket closes under a collective
            store.add("finished", 1)
            deadline = time.monotonic() + 10
            while int(store.add("finished", 0)) < world and time.monotonic() < deadline:
                time.sleep(0.005)
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)


@dataclass
class Launch:
    """Ranks started by :meth:`Hosts.launch`: one process per host, its ranks below it."""

    directory: str
    pids: list[int]
    world: int
    rank_exits: list[float] = field(default_factory=list)

    def wait(self, timeout: float) -> list[Any]:
        """Every rank's result (``("error", text)`` for a rank that failed or died); kills stragglers.

        :attr:`rank_exits` then holds each rank's exit time (``time.time()``; ``inf`` for a
        rank killed at the deadline).
        """
        deadline = time.monotonic() + timeout
        pending = set(self.pids)
        try:
            while pending and time.monotonic() < deadline:
                for pid in list(pending):
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        pending.discard(pid)
                time.sleep(0.02)
        finally:
            for pid in pending:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
        self.rank_exits = []
        results: list[Any] = []
        for r in range(self.world):
            try:
                with open(os.path.join(self.directory, f"rank{r}.exit")) as f:
                    self.rank_exits.append(float(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                self.rank_exits.append(float("inf"))
            path = os.path.join(self.directory, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    ok, value = pickle.load(f)
                results.append(value if ok else ("error", value))
            else:
                results.append(("error", f"rank {r} gave no result within {timeout:g} s"))
        shutil.rmtree(self.directory, ignore_errors=True)
        return results
