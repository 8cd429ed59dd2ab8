"""The same-machine shared-memory all_reduce: used where it can be, exact, agreed, bounded.

Every multi-process test elsewhere runs through it too (it is the default on
this machine); these tests pin down what is specific to it, and keep the
process-group path (gloo) covered with it turned off.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.dist_harness import launch
from _helpers.equivalence import run_standard_cases, standard_cases, tolerance
from _helpers.load import Load
from _helpers.marks import needs_shm
from syncbn import _shm, groups

pytestmark = needs_shm

SHORT = 2.0


def _group() -> groups.ProcessGroupSum:
    group = groups.resolve(None)
    assert isinstance(group, groups.ProcessGroupSum)
    return group


def _steps(rank: int, layer: torch.nn.Module, steps: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    grads = []
    for _ in range(steps):
        x = torch.randn(3 + rank, 5, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        layer(x).backward(torch.randn(x.shape, generator=gen, dtype=torch.float64))
        grads.append(x.grad.flatten())
    return torch.cat(grads)


def _same_bits_and_same_as_gloo(rank: int, world_size: int) -> dict[str, Any]:
    shared = syncbn.SyncBatchNorm2d(5).double()
    on_gloo = syncbn.SyncBatchNorm2d(
        5, process_group=groups.ProcessGroupSum(None, shared_memory=False)
    ).double()
    grad_shared = _steps(rank, shared)
    grad_gloo = _steps(rank, on_gloo)
    stats = torch.cat([shared.running_mean, shared.running_var])
    table = torch.zeros(world_size, stats.numel(), dtype=torch.float64)
    table[rank] = stats
    dist.all_reduce(table)
    return {
        "shared": _group().uses_shared_memory,
        "gloo_layer_shared": on_gloo.process_group.uses_shared_memory,
        "stats_equal_on_every_rank": all(torch.equal(table[0], row) for row in table),
        "vs_gloo": max(
            (grad_shared - grad_gloo).abs().max().item(),
            (shared.running_var - on_gloo.running_var).abs().max().item(),
        ),
    }


def test_used_by_default_every_rank_gets_the_same_bits_and_equals_gloo() -> None:
    for result in launch(_same_bits_and_same_as_gloo, 3, timeout=90):
        assert result["shared"] is True
        assert result["gloo_layer_shared"] is False
        assert result["stats_equal_on_every_rank"]
        assert result["vs_gloo"] < 1e-12


def _process_group_path(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_shared_memory(False)
    out = run_standard_cases(rank, world_size)
    out["shared"] = _group().uses_shared_memory
    return out


def test_process_group_path_still_matches_global_batchnorm() -> None:
    for rank, result in enumerate(launch(_process_group_path, 2, timeout=180)):
        assert result.pop("shared") is False
        for case in standard_cases(2):
            errors = result[case.name]
            assert isinstance(errors, dict), f"rank {rank} {case.name}: {errors}"
            tol = tolerance(case)
            for key, value in errors.items():
                assert value <= tol, f"rank {rank} {case.name} {key}: {value:.3g} > {tol:.3g}"


def _refused(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """One rank cannot or will not use shared memory; the other is willing."""
    if rank == 1 and how == "disabled":
        syncbn.set_shared_memory(False)
    if rank == 1 and how == "other-machine":
        _shm._host_key = lambda: 12345.0  # type: ignore[assignment]
    if rank == 0 and how == "no-segment":
        _shm._create = lambda *args: None  # type: ignore[assignment]
    if rank == 1 and how == "no-attach":
        _shm._attach = lambda *args: None  # type: ignore[assignment]
    layer = syncbn.SyncBatchNorm1d(3).double()
    x = torch.arange(6.0, dtype=torch.float64).view(2, 3) + 10 * rank
    layer(x)
    leftovers = glob.glob(f"/dev/shm/syncbn-{os.getpid()}-*") if rank == 0 else []
    return {"shared": _group().uses_shared_memory, "mean": layer.running_mean.tolist(), "left": leftovers}


@pytest.mark.parametrize("how", ["disabled", "other-machine", "no-segment", "no-attach"])
def test_a_rank_that_cannot_or_will_not_use_it_keeps_every_rank_on_the_process_group(how: str) -> None:
    results = launch(_refused, 2, how, timeout=60)
    full = torch.cat([torch.arange(6.0, dtype=torch.float64).view(2, 3) + 10 * r for r in range(2)])
    expected = (0.1 * full.mean(0)).tolist()
    for result in results:
        assert result["shared"] is False
        assert result["mean"] == pytest.approx(expected, abs=1e-12)
        assert result["left"] == []


def _sizes(rank: int, world_size: int) -> dict[str, Any]:
    group = _group()
    small = torch.full((7,), float(rank + 1), dtype=torch.float64)
    big = torch.full((20_000,), float(rank + 1), dtype=torch.float64)  # more than one slot holds
    half = torch.full((3, 5), float(rank + 1), dtype=torch.float32)
    group.all_reduce_sum(small)
    group.all_reduce_sum(big)
    group.all_reduce_sum(half)
    mine = f"/dev/shm/syncbn-{os.getpid()}-*"
    return {
        "shared": group.uses_shared_memory,
        "small": small.unique().tolist(),
        "big": big.unique().tolist(),
        "half": half.unique().tolist(),
        "dtype": str(half.dtype),
        "left_in_dev_shm": glob.glob(mine),
    }


def test_any_size_and_dtype_is_summed_and_the_segment_is_unlinked() -> None:
    for result in launch(_sizes, 3, timeout=60):
        assert result["shared"] is True
        assert result["small"] == result["big"] == result["half"] == [6.0]
        assert result["dtype"] == "torch.float32"
        assert result["left_in_dev_shm"] == []


def _peer_misses_second_call(rank: int, world_size: int, shared: bool, how: str) -> dict[str, Any]:
    """Both ranks make one training call; rank 1 then sleeps past the bound or exits."""
    syncbn.set_shared_memory(shared)
    syncbn.set_timeout(SHORT if how == "late" else 20.0)
    layer = syncbn.SyncBatchNorm1d(4)
    layer(torch.randn(3, 4))  # set-up and the handshake succeed on both ranks
    if rank == 1:
        if how == "dead":
            os._exit(3)
        time.sleep(SHORT + 3)  # never joins the second call in time
        return {"type": None}
    start = time.monotonic()
    try:
        layer(torch.randn(3, 4))
    except syncbn.CollectiveError as exc:
        return {
            "type": "CollectiveError",
            "timed_out": exc.timed_out,
            "s": time.monotonic() - start,
            "msg": str(exc),
        }
    return {"type": None}


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "process-group"])
def test_a_late_peer_gives_a_bounded_timeout_error(shared: bool) -> None:
    with Load() as load:
        result, _ = launch(_peer_misses_second_call, 2, shared, "late", timeout=60)
    assert result["type"] == "CollectiveError", result
    # At the bound; then 2.5 s of quiet-machine work at the load measured.
    assert result["timed_out"] and SHORT * 0.9 < result["s"] < SHORT + load.margin(2.5), (result, load)
    assert "did not" in result["msg"] or "not every rank arrived" in result["msg"]
    assert ("shared memory" in result["msg"]) is shared


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "process-group"])
def test_a_dead_peer_gives_a_prompt_error(shared: bool) -> None:
    survivor, dead = launch(
        _peer_misses_second_call, 2, shared, "dead", timeout=60, allow_failures=True, finish_wait=0.5
    )
    assert dead[0] == "error"
    assert survivor["type"] == "CollectiveError" and not survivor["timed_out"], survivor
    assert survivor["s"] < 20.0 and "died" in survivor["msg"], survivor  # found before the 20 s bound


def _swapped_order(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(SHORT)
    first, second = syncbn.SyncBatchNorm1d(3), syncbn.SyncBatchNorm1d(5)
    first(torch.randn(4, 3))
    second(torch.randn(4, 5))  # both handshakes done: no check runs on later calls
    layers = (first, second) if rank == 0 else (second, first)
    start = time.monotonic()
    try:
        layers[0](torch.randn(4, layers[0].num_features))
    except syncbn.CollectiveError as exc:
        return {"type": "CollectiveError", "s": time.monotonic() - start, "msg": str(exc)}
    return {"type": None}


def test_ranks_calling_layers_in_different_orders_get_an_error_not_wrong_numbers() -> None:
    for result in launch(_swapped_order, 2, timeout=60):
        assert result["type"] == "CollectiveError", result
        assert result["s"] < SHORT  # at once: before the bound a wait would reach
        assert "did not make the same collective" in result["msg"]
        assert "forward of float64, call 5, 7 values" in result["msg"], result["msg"]
        assert "forward of float64, call 5, 11 values" in result["msg"], result["msg"]


def _rebuilt_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(SHORT)
    layer = syncbn.SyncBatchNorm1d(4)
    layer(torch.randn(3, 4))  # handshake done on both ranks
    if rank == 1:
        layer = syncbn.SyncBatchNorm1d(4)  # a new, unverified layer: its next call is a handshake
    try:
        layer(torch.randn(3, 4))
    except syncbn.CollectiveError as exc:
        return {"type": "CollectiveError", "msg": str(exc)}
    return {"type": None}


def test_a_layer_rebuilt_on_one_rank_gives_an_error_on_every_rank_not_an_abort() -> None:
    # On gloo the two ranks' collectives differ in size (moments vs the handshake table): an abort.
    for result in launch(_rebuilt_on_one_rank, 2, timeout=60):
        assert result["type"] == "CollectiveError", result
        assert "did not make the same collective" in result["msg"]


def test_setting_validation_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("SYNCBN_SHM", "0")
        syncbn.set_shared_memory(None)
        assert syncbn.shared_memory_enabled() is False
        monkeypatch.setenv("SYNCBN_SHM", "1")
        assert syncbn.shared_memory_enabled() is True
        syncbn.set_shared_memory(False)
        assert syncbn.shared_memory_enabled() is False
        with pytest.raises(TypeError, match="expected True, False or None"):
            syncbn.set_shared_memory("yes")  # type: ignore[arg-type]
    finally:
        syncbn.set_shared_memory(None)


def test_a_full_memory_means_no_segment_and_no_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    assert _shm._create(f"syncbn-{os.getpid()}-000000000007", 1 << 20, 7) is None
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert glob.glob(f"/dev/shm/syncbn-{os.getpid()}-*") == []


def test_the_segment_has_no_path_and_only_its_creator_and_token_open_it() -> None:
    made = _shm._create(f"syncbn-{os.getpid()}-00000000002a", 8192, 42)
    assert made is not None
    fd, segment = made
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:syncbn-{os.getpid()}-")
        assert glob.glob(f"/dev/shm/syncbn-{os.getpid()}-*") == []
        peer = _shm._attach(os.getpid(), fd, 8192, 42)
        assert peer is not None
        peer[100:103] = b"abc"
        assert segment[100:103] == b"abc"  # the same memory
        peer.close()
        assert _shm._attach(os.getpid(), fd, 8192, 43) is None  # another token: not ours
        assert _shm._attach(os.getpid(), fd, 4096, 42) is None  # another size
        assert _shm._attach(os.getpid(), 987654, 8192, 42) is None  # no such descriptor
    finally:
        segment.close()
        os.close(fd)


def _proc_refused(rank: int, world_size: int, socket_too: bool) -> dict[str, Any]:
    """Rank 1 may not open rank 0's /proc/<pid>/fd (as for a non-dumpable process)."""
    if rank == 1:
        _shm._open_proc = lambda *args: None  # type: ignore[assignment]
        if socket_too:
            _shm._receive = lambda *args: None  # type: ignore[assignment]
    layer = syncbn.SyncBatchNorm1d(3).double()
    x = torch.arange(6.0, dtype=torch.float64).view(2, 3) + 10 * rank
    layer(x)
    return {"shared": _group().uses_shared_memory, "mean": layer.running_mean.tolist()}


@pytest.mark.parametrize("socket_too", [False, True], ids=["socket-hands-it-over", "both-refused"])
def test_where_proc_is_refused_the_descriptor_comes_over_a_socket(socket_too: bool) -> None:
    full = torch.cat([torch.arange(6.0, dtype=torch.float64).view(2, 3) + 10 * r for r in range(2)])
    for result in launch(_proc_refused, 2, socket_too, timeout=60):
        assert result["shared"] is not socket_too, result
        assert result["mean"] == pytest.approx((0.1 * full.mean(0)).tolist(), abs=1e-12)


def test_the_socket_hands_the_descriptor_to_the_same_user_only_while_open() -> None:
    made = _shm._create(f"syncbn-{os.getpid()}-00000000002b", 8192, 43)
    assert made is not None
    fd, segment = made
    name = f"syncbn-{os.getpid()}-00000000002b"
    server = _shm._Server(name, fd)
    try:
        time.sleep(0.2)  # past the server's first idle accept timeout (Python 3.9: socket.timeout)
        got = _shm._receive(name)
        assert got is not None
        assert os.fstat(got).st_ino == os.fstat(fd).st_ino  # the very segment
        os.close(got)
    finally:
        server.close()
        segment.close()
        os.close(fd)
    assert _shm._receive(name, timeout=0.5) is None  # gone with the server: no name left


# ------------------------------------------------------- a kill inside the set-up window (item 2)

_PAUSE_S = 60.0


def _paused_in_setup(rank: int, world_size: int, tmp: str, where: str) -> dict[str, Any]:
    """Rank 0 (``created``) or rank 1 (``attached``) stops inside the set-up window and says so."""
    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    create, attach = _shm._create, _shm._attach

    def mark(detail: dict[str, Any]) -> None:
        with open(os.path.join(tmp, "marker.tmp"), "w") as f:
            json.dump({"pids": pids, **detail}, f)
        os.replace(os.path.join(tmp, "marker.tmp"), os.path.join(tmp, "marker"))
        time.sleep(_PAUSE_S)

    def created(*args: Any) -> Any:
        made = create(*args)
        if made is not None and where == "created":
            mark({"fd": made[0]})
        return made

    def attached(*args: Any) -> Any:
        segment = attach(*args)
        if where == "attached":
            mark({"fd": args[1]})
        return segment

    _shm._create = created  # type: ignore[assignment]
    _shm._attach = attached  # type: ignore[assignment]
    try:
        syncbn.SyncBatchNorm1d(3)(torch.randn(4, 3))
    except Exception as exc:  # noqa: BLE001 - a survivor reports what it saw
        return {"type": type(exc).__name__}
    return {"type": None}


def _kill_at_marker(tmp: str, kill: str, seen: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    path = os.path.join(tmp, "marker")
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path) as f:
        marker = json.load(f)
    pids = marker["pids"]
    seen["pids"] = pids
    seen["segment"] = os.readlink(f"/proc/{pids[0]}/fd/{marker['fd']}")  # it exists now...
    seen["during"] = [p for pid in pids for p in glob.glob(f"/dev/shm/syncbn-{pid}-*")]
    for pid in pids if kill == "every rank" else pids[:1]:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("where", "kill"),
    [("created", "rank 0"), ("created", "every rank"), ("attached", "every rank")],
    ids=["rank0-after-create", "all-after-create", "all-after-late-rank-attached"],
)
def test_a_kill_inside_the_set_up_window_leaves_nothing(where: str, kill: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        seen: dict[str, Any] = {}
        killer = threading.Thread(target=_kill_at_marker, args=(tmp, kill, seen), daemon=True)
        killer.start()
        results = launch(_paused_in_setup, 2, tmp, where, timeout=60, allow_failures=True, finish_wait=0.5)
        killer.join(timeout=10)
    pids = seen["pids"]
    # The kill landed inside the window: rank 0 held the segment (a memfd, no file anywhere).
    assert seen["segment"].startswith(f"/memfd:syncbn-{pids[0]}-"), seen
    assert seen["during"] == [], seen
    assert results[0][0] == "error" and "exit code -9" in results[0][1], results
    if kill == "every rank":
        assert results[1][0] == "error" and "exit code -9" in results[1][1], results
    else:  # the survivor gets an error from the process group (its peer is gone), never a hang
        assert isinstance(results[1], dict) and results[1]["type"] is not None, results
    for pid in pids:
        assert glob.glob(f"/dev/shm/syncbn-{pid}-*") == []
        assert not _shm._alive(pid)
