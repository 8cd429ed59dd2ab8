"""syncbn.compat: the sync_batchnorm package's API and MegEngine's SyncBatchNorm."""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import syncbn
from _helpers.compare import assert_same_step
from _helpers.dist_harness import launch_once
from _helpers.marks import needs_cuda
from syncbn.compat import megengine as mge
from syncbn.compat import sync_batchnorm as sb
from syncbn.convert import BatchNorm

SYNCHRONIZED = [
    (sb.SynchronizedBatchNorm1d, nn.BatchNorm1d, syncbn.SyncBatchNorm1d, (6, 4)),
    (sb.SynchronizedBatchNorm1d, nn.BatchNorm1d, syncbn.SyncBatchNorm1d, (6, 4, 3)),
    (sb.SynchronizedBatchNorm2d, nn.BatchNorm2d, syncbn.SyncBatchNorm2d, (6, 4, 3, 2)),
    (sb.SynchronizedBatchNorm3d, nn.BatchNorm3d, syncbn.SyncBatchNorm3d, (6, 4, 2, 3, 2)),
]


# ---------------------------------------------------------------- sync_batchnorm, one process


def test_public_names_match_the_package() -> None:
    for name in (
        "SynchronizedBatchNorm1d",
        "SynchronizedBatchNorm2d",
        "SynchronizedBatchNorm3d",
        "DataParallelWithCallback",
        "patch_replication_callback",
        "convert_model",
        "patch_sync_batchnorm",
        "set_sbn_eps_mode",
        "CallbackContext",
        "execute_replication_callbacks",
    ):
        assert name in sb.__all__ and hasattr(sb, name)


@pytest.mark.parametrize("ours_cls, ref_cls, base, shape", SYNCHRONIZED)
def test_synchronized_classes_take_the_package_constructor_and_are_batchnorm(
    ours_cls: Any, ref_cls: Any, base: Any, shape: tuple[int, ...]
) -> None:
    bn = ours_cls(4, 1e-3, 0.2, False, False)  # positional, as in the package
    assert (bn.num_features, bn.eps, bn.momentum, bn.affine) == (4, 1e-3, 0.2, False)
    assert bn.track_running_stats is False and bn.running_mean is None
    assert isinstance(bn, base) and bn.process_group is None
    # The package's five arguments first, with its defaults; then syncbn.SyncBatchNorm's own.
    params = list(inspect.signature(ours_cls).parameters.values())
    assert [(p.name, p.default) for p in params[:5]] == [
        ("num_features", inspect.Parameter.empty),
        ("eps", 1e-5),
        ("momentum", 0.1),
        ("affine", True),
        ("track_running_stats", True),
    ]
    assert inspect.signature(ours_cls) == inspect.signature(base)
    assert ours_cls(4, freeze=True, device="cpu", dtype=torch.float64).weight.dtype == torch.float64

    torch.manual_seed(0)
    ours, ref = ours_cls(4), ref_cls(4)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict(), strict=True)
    for training in (True, True, False):
        ours.train(training)
        ref.train(training)
        assert_same_step(ours, ref, torch.randn(shape) * 2 + 3)
        assert torch.equal(ours.weight.grad, ref.weight.grad)
    ref.load_state_dict(ours.state_dict(), strict=True)


def test_eps_is_added_to_the_variance_not_a_clamp() -> None:
    # Per-channel variance about eps: the package divides by sqrt(max(var, eps)),
    # BatchNorm by sqrt(var + eps).
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64) * 3e-3
    ours = sb.SynchronizedBatchNorm2d(3).double()
    ref = nn.BatchNorm2d(3).double()
    assert torch.equal(ours(x), ref(x))
    var = x.var((0, 2, 3), unbiased=False).view(1, 3, 1, 1)
    clamped = (x - x.mean((0, 2, 3), keepdim=True)) / var.clamp(min=1e-5).sqrt()
    assert (ours(x) - clamped).abs().max() > 0.1 * clamped.abs().max()


def test_convert_model_swaps_batchnorms_and_keeps_parameters() -> None:
    model = nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4), nn.Unflatten(2, (1, 5)), nn.BatchNorm2d(4))
    weight = model[1].weight
    conv = sb.convert_model(model)
    assert type(conv[1]) is sb.SynchronizedBatchNorm1d and conv[1].weight is weight
    assert type(conv[3]) is sb.SynchronizedBatchNorm2d
    assert conv(torch.randn(2, 3, 5)).shape == (2, 4, 1, 5)
    back = syncbn.revert_sync_batchnorm(conv)
    assert [type(back[1]), type(back[3])] == [nn.BatchNorm1d, nn.BatchNorm2d]
    root = sb.convert_model(nn.BatchNorm3d(2))
    assert type(root) is sb.SynchronizedBatchNorm3d
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module \(got list\)"):
        sb.convert_model([nn.BatchNorm1d(2)])  # type: ignore[arg-type]


def test_convert_model_rewraps_data_parallel_without_gpus() -> None:
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    dp = nn.DataParallel(inner)  # without GPUs: device_ids == [], forward calls the module
    out = sb.convert_model(dp)
    assert type(out) is sb.DataParallelWithCallback and isinstance(out, nn.DataParallel)
    assert out.device_ids == dp.device_ids
    assert out.module is inner and type(inner[1]) is sb.SynchronizedBatchNorm1d
    assert out(torch.randn(5, 3)).shape == (5, 4)


@needs_cuda
def test_convert_model_keeps_device_ids_output_device_and_dim() -> None:
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).cuda()
    dp = nn.DataParallel(inner, device_ids=[0], output_device=0, dim=0)
    out = sb.convert_model(dp)
    assert type(out) is sb.DataParallelWithCallback
    assert (out.device_ids, out.output_device, out.dim) == ([0], 0, 0)
    assert out(torch.randn(5, 3, device="cuda")).shape == (5, 4)


class _Recorder(nn.Module):
    """A module written for the package's replication protocol."""

    def __init__(self, log: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.record = log.append  # copies of the module share it (a builtin method is not deep-copied)
        self.inner = nn.Linear(2, 2)

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        if copy_id == 0:
            ctx.master = id(self)  # the first copy is called first, and leaves this for the others
        self.record((copy_id, id(ctx), ctx.master))


def _copies(module: nn.Module, device_ids: Any) -> list[nn.Module]:
    # What nn.DataParallel.replicate returns (one copy per device), without the GPUs it needs.
    return [copy.deepcopy(module) for _ in device_ids]


def _check_callback_log(log: list[tuple[int, int, int]], copies: int) -> None:
    assert [entry[0] for entry in log] == list(range(copies))
    assert len({entry[1] for entry in log}) == 1  # one context shared by the copies of a submodule
    assert len({entry[2] for entry in log}) == 1


def test_execute_replication_callbacks_follows_the_package_protocol() -> None:
    log: list[tuple[int, int, int]] = []
    model = nn.Sequential(nn.BatchNorm1d(2), _Recorder(log), _Recorder(log))
    sb.execute_replication_callbacks(_copies(model, [0, 1, 2]))
    first = [e for e in log if e[2] == log[0][2]]
    _check_callback_log(first, 3)
    assert len(log) == 6 and len({e[1] for e in log}) == 2  # a context per submodule position
    sb.execute_replication_callbacks([])


def test_data_parallel_with_callback_runs_the_callbacks_after_replicating(monkeypatch: Any) -> None:
    monkeypatch.setattr(nn.DataParallel, "replicate", lambda self, module, ids: _copies(module, ids))
    log: list[tuple[int, int, int]] = []
    dp = sb.DataParallelWithCallback(_Recorder(log))
    replicas = dp.replicate(dp.module, [0, 1])
    assert len(replicas) == 2
    _check_callback_log(log, 2)


def test_patch_replication_callback_wraps_replicate_once() -> None:
    log: list[tuple[int, int, int]] = []
    dp = nn.DataParallel(_Recorder(log))
    dp.replicate = _copies  # type: ignore[method-assign]
    assert sb.patch_replication_callback(dp) is None
    sb.patch_replication_callback(dp)  # a second patch does not run the callbacks twice
    dp.replicate(dp.module, [0, 1])
    _check_callback_log(log, 2)
    with_callback = sb.DataParallelWithCallback(nn.Linear(2, 2))
    before = dict(with_callback.__dict__)
    sb.patch_replication_callback(with_callback)
    assert with_callback.__dict__ == before
    with pytest.raises(TypeError, match=r"expected a torch.nn.DataParallel \(got Linear\)"):
        sb.patch_replication_callback(nn.Linear(2, 2))  # type: ignore[arg-type]


@needs_cuda
def test_data_parallel_with_callback_on_a_gpu() -> None:
    log: list[tuple[int, int, int]] = []
    dp = sb.DataParallelWithCallback(_Recorder(log).cuda(), device_ids=[0])
    dp.replicate(dp.module, [0])
    _check_callback_log(log, 1)


def test_patch_sync_batchnorm_builds_synchronized_layers_inside_only() -> None:
    original = nn.BatchNorm2d
    with sb.patch_sync_batchnorm():
        layer = nn.BatchNorm2d(3)
    assert type(layer) is sb.SynchronizedBatchNorm2d
    assert nn.BatchNorm2d is original and type(nn.BatchNorm1d(2)) is nn.BatchNorm1d
    with pytest.raises(RuntimeError, match="boom"), sb.patch_sync_batchnorm():
        raise RuntimeError("boom")
    assert nn.BatchNorm2d is original


def test_set_sbn_eps_mode() -> None:
    sb.set_sbn_eps_mode("plus")
    with pytest.warns(UserWarning, match="always adds eps"):
        sb.set_sbn_eps_mode("clamp")  # the package's modes: "clamp" (its default) and "plus"
    for wrong in ("clip", "add"):
        with pytest.raises(ValueError, match=rf"expected 'clamp' or 'plus' \(got '{wrong}'\)"):
            sb.set_sbn_eps_mode(wrong)


# ---------------------------------------------------------------- MegEngine, one process


def test_megengine_constructor_and_momentum_convention() -> None:
    bn = mge.SyncBatchNorm(4, 1e-3, 0.8, False, True, False, None)  # MegEngine's positional order
    assert (bn.eps, bn.affine, bn.freeze, bn.group, bn.process_group) == (1e-3, False, False, None, None)
    assert bn.momentum == pytest.approx(0.2)
    assert "momentum=0.8 (MegEngine convention)" in repr(bn)
    sentinel = object()
    bn.group = sentinel
    assert bn.process_group is sentinel

    torch.manual_seed(0)
    ours = mge.SyncBatchNorm(4, momentum=0.9).double()
    x = torch.randn(16, 4, 3, 3, dtype=torch.float64) * 2 + 1
    ours(x)
    mean = x.mean((0, 2, 3))
    var = x.var((0, 2, 3), unbiased=True)
    assert torch.allclose(ours.running_mean, 0.9 * torch.zeros(4, dtype=torch.float64) + 0.1 * mean)
    assert torch.allclose(ours.running_var, 0.9 * torch.ones(4, dtype=torch.float64) + 0.1 * var)
    ref = nn.BatchNorm2d(4, momentum=1 - 0.9).double()
    ref(x)
    assert torch.equal(ours.running_mean, ref.running_mean)
    assert torch.equal(ours.running_var, ref.running_var)
    with pytest.raises(TypeError, match="expected momentum to be a float"):
        mge.SyncBatchNorm(4, momentum=None)  # type: ignore[arg-type]


def test_megengine_takes_a_module_name() -> None:
    assert mge.SyncBatchNorm(3, name="bn1").name == "bn1"
    assert mge.SyncBatchNorm(3).name is None
    with pytest.raises(ValueError, match=r"non-empty string or None, got ' '"):
        mge.SyncBatchNorm(3, name=" ")
    with pytest.raises(TypeError, match="non-empty string or None, got int"):
        mge.SyncBatchNorm(3, name=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 5), (6, 3, 4, 2)])
def test_megengine_accepts_2d_3d_4d(shape: tuple[int, ...]) -> None:
    bn = mge.SyncBatchNorm(3)
    ref = nn.BatchNorm1d(3, momentum=1 - 0.9) if len(shape) < 4 else nn.BatchNorm2d(3, momentum=1 - 0.9)
    x = torch.randn(shape)
    assert torch.equal(bn(x), ref(x))
    assert torch.equal(bn.running_var, ref.running_var)


@pytest.mark.parametrize("dims", [1, 5])
def test_megengine_rejects_other_ranks(dims: int) -> None:
    bn = mge.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=rf"^expected 2D, 3D or 4D input \(got {dims}D input\)$"):
        bn(torch.randn(*([3] * dims)))


def test_megengine_freeze_uses_and_keeps_running_stats_and_trains_nothing() -> None:
    torch.manual_seed(0)
    bn = mge.SyncBatchNorm(4, freeze=True).double()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    ref = nn.BatchNorm2d(4).double()
    ref.load_state_dict(bn.state_dict())
    ref.eval()
    before = copy.deepcopy(bn.state_dict())
    x = torch.randn(5, 4, 3, 3, dtype=torch.float64)
    bn.train()
    assert_same_step(bn, ref, x)
    assert bn.weight.grad is None and bn.bias.grad is None
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="track_running_stats=True"):
        mge.SyncBatchNorm(4, track_running_stats=False, freeze=True)


def test_megengine_without_running_stats_uses_batch_statistics_in_eval() -> None:
    bn = mge.SyncBatchNorm(3, track_running_stats=False).eval()
    x = torch.randn(6, 3, 4) * 3 + 2
    assert bn.running_mean is None
    assert torch.equal(bn(x), F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps))
    assert not bn.training  # the eval forward left the mode as it was


def test_megengine_without_running_stats_uses_the_replicas_batch_statistics_in_eval() -> None:
    from syncbn.parallel import data_parallel

    bn = mge.SyncBatchNorm(2, track_running_stats=False).double().eval()
    x = torch.randn(6, 2, 3, dtype=torch.float64) * 2 + torch.arange(6, dtype=torch.float64).view(6, 1, 1)
    y = data_parallel(bn, x, chunks=[2, 4])  # each replica sees only its chunk
    want = F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)  # the whole batch's statistics
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    assert not bn.training


def test_megengine_reverts_to_an_equivalent_plain_batchnorm() -> None:
    bn = mge.SyncBatchNorm(3, momentum=0.9)
    bn(torch.randn(8, 3, 2, 2))
    bn.eval()
    x = torch.randn(4, 3, 2, 2)
    want = bn(x)
    back = syncbn.revert_sync_batchnorm(bn)
    assert type(back) is BatchNorm and back.momentum == bn.momentum
    assert not hasattr(back, "process_group")
    assert torch.equal(back(x), want)
    state = back.state_dict()
    plain = nn.BatchNorm2d(3)
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain.eval()(x), want)


# ---------------------------------------------------------------- 2 gloo ranks vs the global batch

Factory = Callable[[], nn.Module]


def _compare(
    rank: int,
    make_ours: Factory,
    make_ref: Factory,
    sizes: list[int],
    inner: tuple[int, ...],
    *,
    ref_eval: bool = False,
    ours_eval: bool = False,
    frozen: bool = False,
    steps: int = 2,
) -> dict[str, float]:
    """Run ``make_ours()`` on this rank's shard and ``make_ref()`` (float64) on the global batch."""
    gen = torch.Generator().manual_seed(3)
    ours, ref = make_ours().double(), make_ref().double()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                c = m.num_features
                if m.weight is not None:
                    m.weight.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
                    m.bias.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
                    m.running_var.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
    ours.load_state_dict(ref.state_dict(), strict=True)
    if ref_eval:
        ref.eval()
    if ours_eval:
        ours.eval()
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    errors: dict[str, float] = {}

    def note(key: str, value: float) -> None:
        errors[key] = max(errors.get(key, 0.0), value)

    for _ in range(steps):
        full = torch.randn(sum(sizes), *inner, generator=gen, dtype=torch.float64) * 2 + 1
        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref)
        grad = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
        ref.zero_grad()
        y_ref.backward(grad)
        x = full[start:stop].clone().requires_grad_()
        ours.zero_grad()
        y = ours(x)
        y.backward(grad[start:stop])
        if stop > start:
            note("output", (y - y_ref[start:stop]).abs().max().item())
            note("grad_input", (x.grad - x_ref.grad[start:stop]).abs().max().item())
        for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
            if frozen:  # a frozen layer trains neither weight nor bias
                note("grad_present:" + name, float(p.grad is not None))
                continue
            g = p.grad.clone() if p.grad is not None else torch.full_like(p, float("nan"))
            dist.all_reduce(g)  # weight/bias gradients are per rank: their sum is the global one
            note("grad:" + name, (g - p_ref.grad).abs().max().item())
        for (k, v), v_ref in zip(ours.state_dict().items(), ref.state_dict().values()):
            note("state:" + k, (v.double() - v_ref.double()).abs().max().item())
    return errors


def _dist_cases(rank: int, world_size: int) -> dict[str, Any]:
    momentum = 1 - 0.9  # MegEngine's 0.9 is PyTorch's 0.1, to the last bit of 1 - 0.9
    cases: dict[str, Callable[[], dict[str, float]]] = {
        "synchronized-1d-2D": lambda: _compare(
            rank, lambda: sb.SynchronizedBatchNorm1d(5), lambda: nn.BatchNorm1d(5), [3, 6], (5,)
        ),
        "synchronized-1d-3D": lambda: _compare(
            rank, lambda: sb.SynchronizedBatchNorm1d(4), lambda: nn.BatchNorm1d(4), [2, 3], (4, 6)
        ),
        "synchronized-2d": lambda: _compare(
            rank, lambda: sb.SynchronizedBatchNorm2d(4), lambda: nn.BatchNorm2d(4), [1, 4], (4, 3, 5)
        ),
        "synchronized-3d-one-empty": lambda: _compare(
            rank, lambda: sb.SynchronizedBatchNorm3d(3), lambda: nn.BatchNorm3d(3), [0, 3], (3, 2, 3, 2)
        ),
        "synchronized-momentum-none": lambda: _compare(
            rank,
            lambda: sb.SynchronizedBatchNorm2d(4, momentum=None),
            lambda: nn.BatchNorm2d(4, momentum=None),
            [2, 5],
            (4, 3, 3),
            steps=3,
        ),
        "megengine-2D": lambda: _compare(
            rank, lambda: mge.SyncBatchNorm(5), lambda: nn.BatchNorm1d(5, momentum=momentum), [4, 2], (5,)
        ),
        "megengine-3D": lambda: _compare(
            rank, lambda: mge.SyncBatchNorm(3), lambda: nn.BatchNorm1d(3, momentum=momentum), [2, 3], (3, 7)
        ),
        "megengine-4D": lambda: _compare(
            rank,
            lambda: mge.SyncBatchNorm(4),
            lambda: nn.BatchNorm2d(4, momentum=momentum),
            [3, 1],
            (4, 3, 3),
        ),
        "megengine-momentum-0.7": lambda: _compare(
            rank,
            lambda: mge.SyncBatchNorm(4, momentum=0.7),
            lambda: nn.BatchNorm2d(4, momentum=1 - 0.7),
            [2, 3],
            (4, 2, 2),
            steps=3,
        ),
        "megengine-freeze": lambda: _compare(
            rank,
            lambda: mge.SyncBatchNorm(4, freeze=True),
            lambda: nn.BatchNorm2d(4),
            [2, 3],
            (4, 3, 3),
            ref_eval=True,
            frozen=True,
        ),
        "megengine-no-running-stats": lambda: _compare(
            rank,
            lambda: mge.SyncBatchNorm(4, track_running_stats=False),
            lambda: nn.BatchNorm2d(4, track_running_stats=False),
            [3, 2],
            (4, 2, 3),
        ),
        # MegEngine: no running statistics -> the group's batch statistics in eval too.
        "megengine-no-running-stats-eval": lambda: _compare(
            rank,
            lambda: mge.SyncBatchNorm(3, track_running_stats=False),
            lambda: nn.BatchNorm1d(3, track_running_stats=False),
            [4, 1],
            (3, 5),
            ours_eval=True,
        ),
        "megengine-no-running-stats-eval-issue": lambda: _issue_12_example(rank),
        "convert-model": lambda: _compare(
            rank,
            lambda: sb.convert_model(_conv_net()),
            _conv_net,
            [2, 4],
            (3, 4, 4),
        ),
    }
    out: dict[str, Any] = {}
    for name, run in cases.items():
        try:
            out[name] = run()
        except Exception as exc:  # noqa: BLE001 - reported per case
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _issue_12_example(rank: int) -> dict[str, float]:
    bn = mge.SyncBatchNorm(1, track_running_stats=False).double()
    x = torch.tensor([[0.0], [2.0]], dtype=torch.float64) + 10.0 * rank
    train = bn(x)
    bn.eval()
    evaluated = bn(x)
    global_batch = torch.tensor([[0.0], [2.0], [10.0], [12.0]], dtype=torch.float64)  # mean 6, var 26
    want = ((global_batch - 6.0) / (26.0 + bn.eps) ** 0.5)[2 * rank : 2 * rank + 2]
    return {
        "train": (train - want).abs().max().item(),
        "eval": (evaluated - want).abs().max().item(),
        "eval_mode_kept": float(bn.training),
    }


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))


CASE_NAMES = [
    "synchronized-1d-2D",
    "synchronized-1d-3D",
    "synchronized-2d",
    "synchronized-3d-one-empty",
    "synchronized-momentum-none",
    "megengine-2D",
    "megengine-3D",
    "megengine-4D",
    "megengine-momentum-0.7",
    "megengine-freeze",
    "megengine-no-running-stats",
    "megengine-no-running-stats-eval",
    "megengine-no-running-stats-eval-issue",
    "convert-model",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_compat_layers_on_two_ranks_equal_batchnorm_on_the_global_batch(name: str) -> None:
    for rank, result in enumerate(launch_once(_dist_cases, 2, timeout=120)):
        errors = result[name]
        assert isinstance(errors, dict), f"rank {rank}: {errors}"
        assert errors, f"rank {rank}: nothing compared"
        for key, value in errors.items():
            assert value <= 1e-12, f"rank {rank} {name} {key}: {value}"


def test_compat_layers_copy_and_pickle() -> None:
    for layer in (sb.SynchronizedBatchNorm2d(3), mge.SyncBatchNorm(3, momentum=0.8, freeze=True)):
        for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert type(clone) is type(layer)
            assert clone.momentum == layer.momentum and clone.freeze == layer.freeze
            for k, v in layer.state_dict().items():
                assert torch.equal(clone.state_dict()[k], v)
