"""Never hang, never abort: bounded waits, consistency checks, clear errors (issue 5).

Each multi-process scenario runs on 2 real gloo ranks with a syncbn timeout of
seconds; every rank returns what it saw (error type, message, time, whether its
state changed) and the parent asserts on all of them.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable

import pytest
import torch
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.dist_harness import launch
from _helpers.load import Load
from syncbn import groups

SHORT = 2.0  # seconds: the syncbn timeout in scenarios that expect one


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = module.state_dict()
    return all(torch.equal(after[k], v) for k, v in before.items())


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"type": type(exc).__name__, "msg": str(exc), "s": time.monotonic() - start, "exc": exc}
    return {"type": None, "msg": "", "s": time.monotonic() - start}


def _plain(result: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in result.items() if k != "exc"}
    exc = result.get("exc")
    if isinstance(exc, syncbn.CollectiveError):
        out["timed_out"] = exc.timed_out
    return out


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.bn1 = syncbn.SyncBatchNorm2d(channels)


class _Net(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(_Block(channels))
        self.layer2 = nn.Sequential(_Block(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer1, self.layer2):
            for block in layer:
                x = block.bn1(block.conv1(x))
        return x


# --------------------------------------------------------------------------- settings


def test_timeout_setting_env_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYNCBN_TIMEOUT", raising=False)
    syncbn.set_timeout("default")  # re-reads the environment
    assert syncbn.get_timeout() == 300.0
    monkeypatch.setenv("SYNCBN_TIMEOUT", "7.5")
    syncbn.set_timeout("default")
    assert syncbn.get_timeout() == 7.5
    monkeypatch.setenv("SYNCBN_TIMEOUT", "none")
    syncbn.set_timeout("default")
    assert syncbn.get_timeout() is None
    try:
        syncbn.set_timeout(3)
        assert syncbn.get_timeout() == 3.0
        syncbn.set_timeout(0)
        assert syncbn.get_timeout() is None
        with pytest.raises(ValueError, match="non-negative"):
            syncbn.set_timeout(-1)
    finally:
        syncbn.set_timeout("default")
    monkeypatch.setenv("SYNCBN_TIMEOUT", "soon")
    syncbn.set_timeout("default")
    with pytest.raises(ValueError, match="got 'soon'"):
        syncbn.get_timeout()


def test_debug_setting_env_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYNCBN_DEBUG", raising=False)
    syncbn.set_debug(None)
    assert not syncbn.debug_enabled()
    monkeypatch.setenv("SYNCBN_DEBUG", "1")
    syncbn.set_debug(None)
    assert syncbn.debug_enabled()
    try:
        syncbn.set_debug(False)
        assert not syncbn.debug_enabled()
    finally:
        syncbn.set_debug(None)


@pytest.mark.parametrize("variable", ["SYNCBN_DEBUG", "SYNCBN_SHM"])
def test_switch_variables_take_a_fixed_vocabulary(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SYNCBN_SHM=maybe meant on, SYNCBN_DEBUG=ture meant off: a typo is now a ValueError naming it."""
    read = syncbn.debug_enabled if variable == "SYNCBN_DEBUG" else syncbn.shared_memory_enabled
    default = variable == "SYNCBN_SHM"
    syncbn.set_debug(None)
    syncbn.set_shared_memory(None)
    try:
        accepted = {"1": True, " TRUE ": True, "Yes": True, "on": True, "0": False, "false": False}
        accepted |= {"NO": False, "Off": False, "": default, "  ": default}
        for value, want in accepted.items():
            monkeypatch.setenv(variable, value)
            syncbn.set_debug(None)  # the environment is read again
            assert read() is want, (variable, value)
        monkeypatch.delenv(variable)
        syncbn.set_debug(None)
        assert read() is default
        for bad in ("maybe", "ture", "flase", "2", "enabled"):
            monkeypatch.setenv(variable, bad)
            syncbn.set_debug(None)
            with pytest.raises(ValueError) as caught:
                read()
            text = str(caught.value)
            assert text.startswith(f"{variable}: expected one of 1/0/true/false/yes/no/on/off"), text
            assert f"(got {bad!r})" in text, text
    finally:
        monkeypatch.delenv(variable, raising=False)
        syncbn.set_debug(None)


def test_set_timeout_takes_any_real_number_and_never_a_zero_millisecond_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    np = pytest.importorskip("numpy")
    from datetime import timedelta
    from fractions import Fraction

    from syncbn import _config

    try:
        for value, seconds in [(np.int64(5), 5.0), (np.float32(2.5), 2.5), (Fraction(1, 2), 0.5)]:
            syncbn.set_timeout(value)
            assert syncbn.get_timeout() == seconds and isinstance(syncbn.get_timeout(), float), value
        before = syncbn.get_timeout()
        with pytest.raises(ValueError, match=r"^syncbn.set_timeout: expected at most 1e\+09 seconds"):
            syncbn.set_timeout(10**400)  # was a bare OverflowError
        with pytest.raises(ValueError, match=r"^syncbn.set_timeout: expected a non-negative number"):
            syncbn.set_timeout(-(10**400))
        # Finite, beyond a float's range: too long (float() made them inf, read as "no bound").
        for huge in ("1e400", " 1E400 ", np.longdouble("1e400")):
            with pytest.raises(ValueError, match=r"^syncbn.set_timeout: expected at most 1e\+09 seconds"):
                syncbn.set_timeout(huge)
        for negative in ("-1e400", np.longdouble("-1e400")):
            with pytest.raises(ValueError, match=r"^syncbn.set_timeout: expected a non-negative number"):
                syncbn.set_timeout(negative)
        assert syncbn.get_timeout() == before  # nothing changed
        with pytest.raises(TypeError, match="got complex"):
            syncbn.set_timeout(1j)  # type: ignore[arg-type]
        # A positive bound under 1 ms reached torch as 0 ms, its "no timeout": it is 1 ms now.
        # Below a float's range too: the exact value decides the sign (it once read as 0, no bound).
        for negative in (Fraction(-1, 10**400), "-1e-400"):
            with pytest.raises(ValueError, match="expected a non-negative number"):
                syncbn.set_timeout(negative)
        for tiny in (0.0004, 1e-300, Fraction(1, 10**6), Fraction(1, 10**400), "1e-400"):
            syncbn.set_timeout(tiny)
            assert syncbn.get_timeout() == _config.MIN_TIMEOUT_S == 0.001, tiny
            assert _config.timeout_delta() == timedelta(milliseconds=1), tiny
        syncbn.set_timeout(0.0015)
        assert syncbn.get_timeout() == 0.0015
        monkeypatch.setenv("SYNCBN_TIMEOUT", "0.0004")
        syncbn.set_timeout("default")
        assert syncbn.get_timeout() == 0.001
        monkeypatch.setenv("SYNCBN_TIMEOUT", "1e400")
        syncbn.set_timeout("default")
        with pytest.raises(ValueError, match=r"^SYNCBN_TIMEOUT: expected at most 1e\+09 seconds"):
            syncbn.get_timeout()
        for infinite in ("inf", "+Infinity", float("inf")):  # an explicit infinity: still no bound
            syncbn.set_timeout(infinite)
            assert syncbn.get_timeout() is None, infinite
    finally:
        monkeypatch.delenv("SYNCBN_TIMEOUT", raising=False)
        syncbn.set_timeout("default")


def test_name_layers_looks_through_wrappers() -> None:
    net = _Net()
    assert syncbn.name_layers(nn.DataParallel(net)) == 2
    assert net.layer2[0].bn1._syncbn_state.name == "layer2.0.bn1"
    syncbn.name_layers(net, prefix="student")
    assert net.layer1[0].bn1._syncbn_state.name == "student.layer1.0.bn1"
    clone = copy.deepcopy(net)
    assert clone.layer1[0].bn1._syncbn_state.name == "student.layer1.0.bn1"


def test_single_process_is_unaffected_by_debug_mode() -> None:
    syncbn.set_debug(True)
    try:
        bn, ref = syncbn.SyncBatchNorm2d(3), nn.BatchNorm2d(3)
        x = torch.randn(4, 3, 2, 2)
        assert torch.equal(bn(x), ref(x))
    finally:
        syncbn.set_debug(None)


# --------------------------------------------------------------------------- scenarios


def _channel_mismatch(rank: int, world_size: int, debug: bool) -> list[dict[str, Any]]:
    syncbn.set_debug(debug)
    syncbn.set_timeout(SHORT)
    channels = 8 if rank == 0 else 6
    bn = syncbn.SyncBatchNorm1d(channels)
    before = _snapshot(bn)
    first = _attempt(lambda: bn(torch.randn(4, channels)))
    first["unchanged"] = _unchanged(bn, before)
    # The process survives and stays usable: a matching layer afterwards works.
    ok = syncbn.SyncBatchNorm1d(3)
    second = _attempt(lambda: ok(torch.randn(4, 3)))
    return [_plain(first), _plain(second)]


@pytest.mark.parametrize("debug", [False, True], ids=["handshake", "debug"])
def test_channel_mismatch_raises_value_error_on_every_rank(debug: bool) -> None:
    for rank, (first, second) in enumerate(launch(_channel_mismatch, 2, debug, timeout=60)):
        assert first["type"] == "ValueError", (rank, first)
        assert "8 channels" in first["msg"] and "6 channels" in first["msg"], first["msg"]
        assert "channel count" in first["msg"]
        assert first["unchanged"]
        assert second["type"] is None, second


ABSENT = 3.0  # seconds a peer stays away in the tiny-bound scenario


def _tiny_bound_and_bad_switches(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from syncbn import _shm

    out: dict[str, Any] = {}
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    # A bound under 1 ms (0 ms in torch, "no timeout") left rank 0 waiting out the group's 30 s.
    syncbn.set_timeout(0.0004)
    for shared in (True, False) if _shm.supported() else (False,):
        syncbn.set_shared_memory(shared)
        group = dist.new_group([0, 1])
        dist.barrier()
        if rank == 1:
            time.sleep(ABSENT)  # absent from the group's first call
        else:
            bn = syncbn.SyncBatchNorm2d(3, process_group=group).double()
            before = _snapshot(bn)
            result = _attempt(lambda: bn(x))  # noqa: B023 - called at once
            result["unchanged"] = _unchanged(bn, before)
            out["tiny", shared] = _plain(result)
        dist.barrier()
    syncbn.set_timeout(SHORT)
    syncbn.set_shared_memory(None)
    # SYNCBN_SHM=maybe meant on and SYNCBN_DEBUG=ture off: a ValueError on every rank, nothing changed.
    bn = syncbn.SyncBatchNorm2d(3, process_group=dist.new_group([0, 1])).double()
    before = _snapshot(bn)
    for variable in ("SYNCBN_DEBUG", "SYNCBN_SHM", "SYNCBN_HIERARCHICAL"):
        os.environ[variable] = "ture"
        syncbn.set_debug(None)
        result = _attempt(lambda: bn(x))
        result["unchanged"] = _unchanged(bn, before)
        out[variable] = _plain(result)
        del os.environ[variable]
    syncbn.set_debug(None)
    full = torch.randn(8, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out["then"] = bn(full[rank * 4 : rank * 4 + 4]).detach()  # the layer and its group still work
    out["expected"] = nn.BatchNorm2d(3).double()(full)[rank * 4 : rank * 4 + 4].detach()
    return out


def test_a_bound_under_a_millisecond_still_bounds_and_bad_switches_raise_everywhere() -> None:
    results = launch(_tiny_bound_and_bad_switches, 2, timeout=120)
    for key, result in results[0].items():
        if key[0] == "tiny":
            assert result["type"] == "CollectiveError" and result["timed_out"], (key, result)
            # The bound: before the peer even returns (the group's own 30 s once bounded it).
            assert result["s"] < ABSENT, (key, result)
            assert "0.001 s" in result["msg"] and result["unchanged"], (key, result)
    for rank, out in enumerate(results):
        for variable in ("SYNCBN_DEBUG", "SYNCBN_SHM", "SYNCBN_HIERARCHICAL"):
            result = out[variable]
            assert result["type"] == "ValueError", (rank, variable, result)
            assert (
                result["msg"].startswith(f"{variable}: expected one of") and "(got 'ture')" in result["msg"]
            )
            assert result["unchanged"], (rank, variable)
        torch.testing.assert_close(out["then"], out["expected"], rtol=0, atol=1e-12)


def _dtype_mismatch(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(SHORT)
    bn = syncbn.SyncBatchNorm1d(3).double()
    before = _snapshot(bn)
    dtype = torch.float64 if rank == 0 else torch.float32
    result = _attempt(lambda: bn(torch.randn(5, 3, dtype=dtype)))
    result["unchanged"] = _unchanged(bn, before)
    return _plain(result)


def test_dtype_mismatch_raises_value_error_on_every_rank() -> None:
    for result in launch(_dtype_mismatch, 2, timeout=60):
        assert result["type"] == "ValueError", result
        assert "torch.float64" in result["msg"] and "torch.float32" in result["msg"], result["msg"]
        assert result["unchanged"]


def _layer_order(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_debug(True)
    syncbn.set_timeout(SHORT)
    net = _Net()
    syncbn.name_layers(net)
    a, b = net.layer1[0].bn1, net.layer2[0].bn1
    x = torch.randn(4, 4, 3, 3)
    a(x)
    b(x)  # one step in the same order
    before = _snapshot(net)
    first, second = (a, b) if rank == 0 else (b, a)
    result = _attempt(lambda: second(first(x)))
    result["unchanged"] = _unchanged(net, before)
    return _plain(result)


def test_layer_order_mismatch_in_debug_mode_names_both_layers() -> None:
    for result in launch(_layer_order, 2, timeout=60):
        assert result["type"] == "ValueError", result
        assert "not calling the same" in result["msg"]
        assert "'layer1.0.bn1'" in result["msg"] and "'layer2.0.bn1'" in result["msg"], result["msg"]
        assert result["unchanged"]


def _eval_while_training(rank: int, world_size: int) -> list[dict[str, Any]]:
    syncbn.set_timeout(SHORT)
    net = _Net()  # no name_layers: the name is found when the error is raised
    x = torch.randn(4, 4, 3, 3, requires_grad=True)
    net(x).backward(torch.randn(4, 4, 3, 3))  # one step together
    if rank == 1:
        net.eval()
    before = _snapshot(net)
    result = _attempt(lambda: net(x))
    result["unchanged"] = _unchanged(net, before)
    return [_plain(result)]


def test_one_rank_in_eval_gives_a_timeout_error_on_the_training_rank() -> None:
    with Load() as load:
        (train,), (evaluating,) = launch(_eval_while_training, 2, timeout=60)
    assert evaluating["type"] is None
    assert train["type"] == "CollectiveError" and train["timed_out"], train
    # At the bound; then 3 s of quiet-machine work at the load measured.
    assert SHORT * 0.9 <= train["s"] < SHORT + load.margin(3.0), (train, load)
    msg = train["msg"]
    for text in ("'layer1.0.bn1'", "2 ranks", "waited 2.0 s", "eval mode", "skipped", "forward"):
        assert text in msg, (text, msg)
    assert "unusable" in msg
    assert train["unchanged"]


def _backward_skipped(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(SHORT)
    bn = syncbn.SyncBatchNorm1d(3)
    syncbn.name_layers(bn, prefix="head.bn")
    x = torch.randn(4, 3, requires_grad=True)
    y = bn(x)
    if rank == 1:
        return {"type": None}
    return _plain(_attempt(lambda: y.backward(torch.randn_like(y))))


def test_timeout_bounds_the_backward_collective() -> None:
    with Load() as load:
        result, _ = launch(_backward_skipped, 2, timeout=60)
    assert result["type"] == "CollectiveError" and result["timed_out"], result
    assert "'head.bn'" in result["msg"] and "backward" in result["msg"]
    assert result["s"] < SHORT + load.margin(3.0), (result, load)


def _peer_exits(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(20.0)  # far longer than "promptly"
    net = _Net()
    syncbn.name_layers(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(5):
        if rank == 1 and step == 2:
            os._exit(17)
        x = torch.randn(4, 4, 3, 3)
        result = _attempt(lambda: net(x).square().mean().backward())  # noqa: B023
        if result["type"] is not None:
            result["step"] = step
            return _plain(result)
        opt.step()
    return {"type": None}


def test_a_peer_that_exits_gives_a_prompt_error_naming_group_and_layer() -> None:
    survivor, dead = launch(_peer_exits, 2, timeout=60, allow_failures=True, finish_wait=0.5)
    assert dead[0] == "error" and "exit code 17" in dead[1]
    assert survivor["type"] == "CollectiveError" and not survivor["timed_out"], survivor
    assert survivor["step"] == 2 and survivor["s"] < 20.0  # found, not waited for: before the 20 s bound
    msg = survivor["msg"]
    assert "'layer1.0.bn1'" in msg and "default group of 2 ranks" in msg and "died" in msg, msg


def _global_count(rank: int, world_size: int) -> list[dict[str, Any]]:
    syncbn.set_timeout(SHORT)
    bn = syncbn.SyncBatchNorm1d(3)
    before = _snapshot(bn)
    one = _attempt(lambda: bn(torch.randn(1 if rank == 0 else 0, 3)))
    one["unchanged"] = _unchanged(bn, before)
    out: list[torch.Tensor] = []
    empty = _attempt(lambda: out.append(bn(torch.randn(0, 3))))
    empty["unchanged"] = _unchanged(bn, before)  # running stats untouched...
    empty["shape"] = list(out[0].shape) if out else None
    empty["tracked"] = int(bn.num_batches_tracked)  # ...num_batches_tracked counts the call
    return [_plain(one), _plain(empty)]


def test_global_count_decisions_are_the_same_on_every_rank() -> None:
    for one, empty in launch(_global_count, 2, timeout=60):
        assert one["type"] == "ValueError" and "Expected more than 1 value" in one["msg"], one
        assert one["unchanged"]
        assert empty["type"] is None and empty["shape"] == [0, 3]


def _bad_inputs(rank: int, world_size: int) -> list[dict[str, Any]]:
    syncbn.set_timeout(SHORT)
    bn = syncbn.SyncBatchNorm2d(4)
    before = _snapshot(bn)
    results = []
    for bad in (
        torch.ones(2, 4, 3, 3, dtype=torch.int64),
        torch.randn(2, 4, 3),
        torch.randn(2, 5, 3, 3),
        torch.randn(4),
    ):
        result = _attempt(lambda: bn(bad))  # noqa: B023
        result["unchanged"] = _unchanged(bn, before)
        results.append(_plain(result))
    # No collective was started by the rejected calls: the next real step lines up.
    results.append(_plain(_attempt(lambda: bn(torch.randn(2, 4, 3, 3)))))
    return results


def test_bad_dtypes_and_shapes_are_rejected_before_any_collective() -> None:
    for results in launch(_bad_inputs, 2, timeout=60):
        *rejected, good = results
        # The channel count: ChannelCountError, a ValueError (and the RuntimeError torch raises).
        assert [r["type"] for r in rejected] == ["TypeError", "ValueError", "ChannelCountError", "ValueError"]
        assert "got dtype torch.int64" in rejected[0]["msg"]
        assert "expected 4D input (got 3D input)" in rejected[1]["msg"]
        assert "expected input with 4 channels" in rejected[2]["msg"] and "got 5" in rejected[2]["msg"]
        assert all(r["unchanged"] for r in rejected)
        assert good["type"] is None, good


def _non_finite(rank: int, world_size: int, debug: bool) -> dict[str, Any]:
    syncbn.set_debug(debug)
    syncbn.set_timeout(SHORT)
    net = _Net()
    syncbn.name_layers(net)
    x = torch.randn(4, 4, 3, 3)
    if rank == 1:
        x[0, 0, 0, 0] = float("nan")
    before = _snapshot(net)
    bn = net.layer1[0].bn1
    out: list[torch.Tensor] = []
    result = _attempt(lambda: out.append(bn(x)))
    result["unchanged"] = _unchanged(net, before)
    if out:  # outside debug mode: the channel is poisoned on every rank, the others are not
        result["nan_channels"] = [bool(out[0][:, c].isnan().all()) for c in range(4)]
        result["nan_running_mean"] = bn.running_mean.isnan().tolist()
    return _plain(result)


def test_non_finite_input_poisons_its_channel_on_every_rank_by_default() -> None:
    for result in launch(_non_finite, 2, False, timeout=60):
        assert result["type"] is None, result
        assert result["nan_channels"] == [True, False, False, False]
        assert result["nan_running_mean"] == [True, False, False, False]


def test_non_finite_input_is_detected_in_debug_mode() -> None:
    for result in launch(_non_finite, 2, True, timeout=60):
        assert result["type"] == "ValueError", result
        assert "rank(s) [1]" in result["msg"] and "NaN" in result["msg"]
        assert "'layer1.0.bn1'" in result["msg"]
        assert result["unchanged"]


class _CountingSum(groups.ProcessGroupSum):
    calls: list[int] = []

    def _framed(self, tensor: torch.Tensor, tag: groups.Tag, **kwargs: Any) -> torch.Tensor:
        _CountingSum.calls.append(tensor.numel())
        return super()._framed(tensor, tag, **kwargs)


def _collectives(rank: int, world_size: int, debug: bool) -> tuple[list[int], float]:
    syncbn.set_debug(debug)
    bn = syncbn.SyncBatchNorm1d(5)
    bn.process_group = _CountingSum(None)
    net = nn.Sequential(nn.Linear(5, 5), bn, nn.Linear(5, 5))
    ref = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Linear(5, 5))
    ref.load_state_dict(net.state_dict())
    gen = torch.Generator().manual_seed(0)
    error = 0.0
    for _ in range(3):
        full = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        x = full[4 * rank : 4 * rank + 4].float().requires_grad_()
        y = net.float()(x)
        y.backward(torch.ones_like(y))
        xf = full.float().requires_grad_()
        ref(xf).backward(torch.ones(8, 5))
        error = max(error, (x.grad - xf.grad[4 * rank : 4 * rank + 4]).abs().max().item())
    return list(_CountingSum.calls), error


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_handshake_once_per_layer_and_debug_checks_every_collective(debug: bool) -> None:
    check = 2 * len(syncbn._checks.FIELDS)  # the check table: world size x its fields
    data = [2 * 5 + 1, 2 * 5]
    for calls, error in launch(_collectives, 2, debug, timeout=60):
        assert error < 1e-5
        if debug:
            assert calls == [check, data[0], check, data[1]] * 3
        else:
            assert calls == [check] + data * 3
