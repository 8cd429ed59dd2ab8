"""nn.DataParallel: syncbn layers in replicas synchronise across the replicas' threads.

CPU tests drive the replicas through :mod:`syncbn.parallel` (replicate, one thread
per replica, gather), the code path ``nn.DataParallel`` takes, and compare with a
float64 ``nn.BatchNorm`` on the whole batch. CUDA tests run ``nn.DataParallel``
itself and are skipped without GPUs.
"""

from __future__ import annotations

import copy
import importlib
import threading
import time

import pytest
import torch
from torch import nn

import syncbn
from _helpers.load import Load
from _helpers.marks import needs_2_gpus, needs_cuda
from _helpers.modules import Scale
from syncbn import parallel
from syncbn._threads import Rendezvous, ReplicaSyncError, ThreadSumGroup, ordered_sum
from syncbn.engine._function import Params, SyncBatchNormFunction

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("short_replica_timeout")]
# A replica timeout for "at once, not after the timeout": an ordering a loaded machine cannot break.
LONG = 20.0

SHAPES = {
    "1d-2D": (syncbn.SyncBatchNorm1d, nn.BatchNorm1d, (4,)),
    "1d-3D": (syncbn.SyncBatchNorm1d, nn.BatchNorm1d, (4, 5)),
    "2d": (syncbn.SyncBatchNorm2d, nn.BatchNorm2d, (4, 3, 5)),
    "3d": (syncbn.SyncBatchNorm3d, nn.BatchNorm3d, (3, 2, 3, 4)),
    "generic": (syncbn.SyncBatchNorm, nn.BatchNorm2d, (4, 3, 3)),
}


def make_pair(bn_cls, ref_cls, channels, dtype=torch.float64, **kwargs):
    """(ours, reference) models with equal parameters and buffers."""
    gen = torch.Generator().manual_seed(1)
    ours = nn.Sequential(Scale(channels), bn_cls(channels, **kwargs)).to(dtype)
    ref = nn.Sequential(Scale(channels), ref_cls(channels, **kwargs)).double()
    with torch.no_grad():
        for m in (ours[1], ref[1]):
            if m.weight is not None:
                m.weight.copy_(torch.rand(channels, generator=gen.manual_seed(2)) + 0.5)
                m.bias.copy_(torch.randn(channels, generator=gen.manual_seed(3)))
            if m.running_mean is not None:
                m.running_mean.copy_(torch.randn(channels, generator=gen.manual_seed(4)))
                m.running_var.copy_(torch.rand(channels, generator=gen.manual_seed(5)) + 0.5)
    return ours, ref


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    scale = max(b.detach().abs().max().item(), 1.0) if b.numel() else 1.0
    err = (a.detach().double() - b.detach().double()).abs().max().item() if b.numel() else 0.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def check_step(ours, ref, x, grad, chunks, tol=1e-10) -> None:
    """One training/eval step through the driver and through the reference; compare everything."""
    ours.zero_grad()
    ref.zero_grad()
    x_ours = x.clone().requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    y = parallel.data_parallel(ours, x_ours, chunks)
    y_ref = ref(x_ref)
    assert y.shape == y_ref.shape
    assert_close(y, y_ref, "output", tol)
    if not torch.is_grad_enabled():
        return
    y.backward(grad.to(y.dtype))
    y_ref.backward(grad.double())
    assert_close(x_ours.grad, x_ref.grad, "input grad", tol)
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        if p_ref.grad is None:
            continue
        assert_close(p.grad, p_ref.grad, f"grad of {name}", tol)
    for (name, b), b_ref in zip(ours.named_buffers(), ref.buffers()):
        assert_close(b, b_ref, f"buffer {name}", tol)


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("chunks", [[3, 4], [2, 0, 5], [1, 1, 1, 4], 3])
def test_matches_batchnorm_on_the_whole_batch(shape_name, chunks) -> None:
    bn_cls, ref_cls, inner = SHAPES[shape_name]
    ours, ref = make_pair(bn_cls, ref_cls, inner[0])
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(7, *inner, generator=gen, dtype=torch.float64) * 2 + 1
        grad = torch.randn(7, *inner, generator=gen, dtype=torch.float64)
        check_step(ours, ref, x, grad, chunks)
        opt.step()
        opt_ref.step()
    assert int(ours[1].num_batches_tracked) == 3


@pytest.mark.parametrize("kwargs", [{"momentum": None}, {"affine": False}, {"track_running_stats": False}])
def test_layer_options(kwargs) -> None:
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4, **kwargs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(9, 4, 3, 3, generator=gen, dtype=torch.float64)
        grad = torch.randn(9, 4, 3, 3, generator=gen, dtype=torch.float64)
        check_step(ours, ref, x, grad, [5, 0, 4])


def test_float32_and_a_large_mean() -> None:
    # BN alone: the reference sees exactly the float32 values the replicas see.
    ours, ref = syncbn.SyncBatchNorm2d(4), nn.BatchNorm2d(4).double()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = (torch.randn(8, 4, 6, 6, generator=gen) * 0.01 + 10.0).float()
        grad = torch.randn(8, 4, 6, 6, generator=gen)
        check_step(ours, ref, x, grad, [3, 5], tol=3e-4)


@pytest.mark.parametrize("family", ["batchnorm", "renorm"])
def test_double_backward_equals_the_layer_on_the_whole_batch(family: str) -> None:
    # A gradient penalty (create_graph=True) through the replicas' joint node: first- and
    # second-order gradients of x, weight and bias as the layer on the whole batch in one process
    # (renorm with r and d away from 1 and 0; its eager double backward is tested on the formulas).
    def make() -> nn.Module:
        torch.manual_seed(3)
        layer = syncbn.SyncBatchNorm1d(3) if family == "batchnorm" else syncbn.SyncBatchRenorm1d(3, r_max=1.5)
        layer = layer.double()
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
            layer.running_mean.fill_(0.3)
            layer.running_var.fill_(2.5)
        return layer

    x = torch.randn(7, 3, 4, dtype=torch.float64) * 2 + 1
    g = torch.randn_like(x)

    def gradients(layer: nn.Module, chunks: list[int] | None) -> list[torch.Tensor]:
        xx = x.clone().requires_grad_(True)
        y = layer(xx) if chunks is None else parallel.data_parallel(layer, xx, chunks=chunks)
        (dx,) = torch.autograd.grad((y * g).sum(), xx, create_graph=True)
        penalty = (dx**2).sum() + (dx * g).sum()
        second = torch.autograd.grad(penalty, [xx, layer.weight, layer.bias], allow_unused=True)
        return [dx.detach()] + [torch.zeros(3) if t is None else t for t in second]

    expected = gradients(make(), None)
    for chunks in ([3, 4], [2, 0, 5]):
        got = gradients(make(), chunks)
        for name, a, b in zip(("dx", "d2x", "d2weight", "d2bias"), got, expected):
            assert (a - b).abs().max().item() < 1e-10, (family, chunks, name)


class NoGradOnFive(nn.Module):
    """Runs its layer under ``torch.no_grad()`` on a chunk of 5 rows (a data-dependent branch)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.norm = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] == 5:
            with torch.no_grad():
                return self.norm(h)
        return self.norm(h)


@pytest.mark.parametrize("family", ["batchnorm", "renorm"])
def test_a_replica_without_grad_gives_a_constant(family: str) -> None:
    # That replica's rows count in the statistics, but nothing it ran is differentiated: as the
    # layer on the whole batch with those rows of its input and output detached (first- and
    # second-order gradients).
    torch.manual_seed(5)
    layer = syncbn.SyncBatchNorm1d(3) if family == "batchnorm" else syncbn.SyncBatchRenorm1d(3, r_max=1.5)
    model = NoGradOnFive(layer.double())
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
        model.norm.running_mean.fill_(0.3)
        model.norm.running_var.fill_(2.5)
    x = torch.randn(10, 3, dtype=torch.float64) * 2 + 1
    g = torch.randn_like(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [model.lin.weight, model.norm.weight, model.norm.bias]

    def gradients(chunks: list[int] | None) -> list[torch.Tensor]:
        model.load_state_dict(state)
        xx = x.clone().requires_grad_(True)
        if chunks is None:  # the reference: the rows of the 5-row chunk (3:8) detached
            h = model.lin(xx)
            y = model.norm(torch.cat([h[:3], h[3:8].detach(), h[8:]]))
            y = torch.cat([y[:3], y[3:8].detach(), y[8:]])
        else:
            y = parallel.data_parallel(model, xx, chunks=chunks)
        first = torch.autograd.grad((y * g).sum(), [xx, *params], create_graph=True)
        penalty = (first[0] ** 2).sum() + (first[0] * g).sum()
        second = torch.autograd.grad(penalty, [xx, *params], allow_unused=True)
        return [t.detach() for t in first] + [torch.zeros(()) if t is None else t for t in second]

    expected = gradients(None)
    got = gradients([3, 5, 2])
    assert got[0][3:8].abs().max().item() == 0.0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert (a - b).abs().max().item() < 1e-10, (family, i)


def test_an_in_place_replica_without_grad_gives_a_constant() -> None:
    # The in-place family writes over its input, which still carries the Linear's graph: the
    # replica's output must be a constant all the same (first order: no double backward there).
    torch.manual_seed(6)
    model = NoGradOnFive(syncbn.InPlaceSyncBatchNorm(3, activation="identity").double())
    ref = copy.deepcopy(model.norm)  # the layer alone on the whole batch
    x = torch.randn(10, 3, dtype=torch.float64) * 2 + 1
    g = torch.randn_like(x)
    xx = x.clone().requires_grad_(True)
    y = parallel.data_parallel(model, xx, chunks=[3, 5, 2])
    got = torch.autograd.grad((y * g).sum(), [xx, model.lin.weight])
    yy = x.clone().requires_grad_(True)
    h = model.lin(yy)
    out = ref(torch.cat([h[:3], h[3:8].detach(), h[8:]]))
    out = torch.cat([out[:3], out[3:8].detach(), out[8:]])
    expected = torch.autograd.grad((out * g).sum(), [yy, model.lin.weight])
    assert got[0][3:8].abs().max().item() == 0.0
    for a, b in zip(got, expected):
        assert (a - b).abs().max().item() < 1e-10


def test_train_eval_switching() -> None:
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4)
    gen = torch.Generator().manual_seed(0)
    for training in (True, False, True, True, False):
        ours.train(training)
        ref.train(training)
        x = torch.randn(6, 4, 3, 3, generator=gen, dtype=torch.float64)
        grad = torch.randn(6, 4, 3, 3, generator=gen, dtype=torch.float64)
        check_step(ours, ref, x, grad, [2, 4])


def test_no_grad_forward_updates_running_stats() -> None:
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        check_step(ours, ref, x, None, [2, 4])
    assert_close(ours[1].running_var, ref[1].running_var, "running_var")


def test_layer_called_twice_per_forward() -> None:
    class Twice(nn.Module):
        def __init__(self, bn: nn.Module) -> None:
            super().__init__()
            self.bn = bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.bn(x) * 2.0 + 1.0)

    ours, ref = Twice(syncbn.SyncBatchNorm1d(3)).double(), Twice(nn.BatchNorm1d(3)).double()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 3, generator=gen, dtype=torch.float64)
        grad = torch.randn(8, 3, generator=gen, dtype=torch.float64)
        check_step(ours, ref, x, grad, [3, 5])
    assert int(ours.bn.num_batches_tracked) == 4


@pytest.mark.parametrize("share_buffers", [True, False])
def test_running_stats_land_on_the_users_module(share_buffers) -> None:
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    replicas = parallel.replicate(ours, 3, share_buffers=share_buffers)
    assert (replicas[0][1].running_mean is ours[1].running_mean) == share_buffers
    outs = parallel.parallel_apply(replicas, list(torch.split(x, [1, 2, 3])))
    assert_close(torch.cat(outs), ref(x), "output")
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(ours[1], key), getattr(ref[1], key), key)
        for replica in replicas:  # every replica computed the same update, bit for bit
            assert torch.equal(getattr(replica[1], key), getattr(ours[1], key))


def test_reproducible_bit_for_bit() -> None:
    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8), nn.ReLU())
        x = torch.randn(13, 3, 7, 7, requires_grad=True)
        y = parallel.data_parallel(model, x, [4, 1, 5, 3])
        y.backward(torch.randn_like(y))
        return [y, x.grad, model[1].running_var, model[1].weight.grad, model[0].weight.grad]

    first = run()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, run()))


def test_single_replica_is_exactly_batchnorm() -> None:
    torch.manual_seed(0)
    ours, ref = syncbn.SyncBatchNorm2d(4), nn.BatchNorm2d(4)
    x = torch.randn(5, 4, 3, 3)
    y = parallel.data_parallel(ours, x, 1)
    assert torch.equal(y, ref(x))
    assert torch.equal(ours.running_var, ref.running_var)


def test_every_chunk_empty() -> None:
    ours = syncbn.SyncBatchNorm2d(4)
    x = torch.randn(0, 4, 3, 3, requires_grad=True)
    y = parallel.data_parallel(ours, x, [0, 0])
    y.backward(torch.randn_like(y))
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(ours.running_mean, torch.zeros(4))
    assert torch.equal(ours.running_var, torch.ones(4))


def test_one_value_per_channel_raises_in_every_replica() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel.*2 replicas"):
        parallel.data_parallel(syncbn.SyncBatchNorm1d(3), torch.randn(1, 3), [1, 0])


def test_cpu_backward_runs_every_replica_in_one_thread() -> None:
    """Why the replicas share ONE autograd node: CPU backward runs all branches in one thread."""
    seen: set[int] = set()

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 1.0
            x.register_hook(lambda g: seen.add(threading.get_ident()))
            return x

    model = nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4), Probe())
    y = parallel.data_parallel(model, torch.randn(8, 3), 4)
    y.backward(torch.randn_like(y))
    assert seen == {threading.get_ident()}


def test_a_blocking_backward_would_fail_on_cpu_but_boundedly() -> None:
    """A per-replica backward that waits for the others cannot complete on CPU; it errors, not hangs."""
    parallel.set_replica_timeout(0.3)

    class Naive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rendezvous: Rendezvous | None = None
            self.rank = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            group = ThreadSumGroup(self.rendezvous, self.rank)
            return SyncBatchNormFunction.apply(x, None, None, Params(None, None, 1e-5, 0.1, group))

    rendezvous = Rendezvous(2, timeout=0.3, label="naive")
    replicas = [Naive(), Naive()]
    for k, r in enumerate(replicas):
        r.rendezvous, r.rank = rendezvous, k
    x = torch.randn(6, 3, requires_grad=True)
    outs = parallel.parallel_apply(replicas, [x[:3], x[3:]])
    with Load() as load:
        start = time.monotonic()
        with pytest.raises(ReplicaSyncError, match="never reached"):
            torch.cat(outs).backward(torch.randn(6, 3))
    # The 0.3 s timeout, then (quiet) well under 5 s of work, at the load measured.
    assert time.monotonic() - start < 0.3 + load.margin(4.7), load


class Branchy(nn.Module):
    """Runs its BN only on chunks with more than ``min_rows`` rows; raises on a chunk of ``boom`` rows."""

    def __init__(self, min_rows: int = 0, boom: int = -1) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = syncbn.SyncBatchNorm1d(4)
        self.min_rows, self.boom = min_rows, boom

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.boom:
            raise KeyError("replica failed before the layer")
        x = self.lin(x)
        return self.norm(x) if x.shape[0] > self.min_rows else x


def test_replica_that_skips_the_layer_gives_a_bounded_error_naming_it() -> None:
    model = Branchy(min_rows=2)
    parallel.set_replica_timeout(1.0)  # (the fixture restores its own afterwards)
    with Load() as load:
        start = time.monotonic()
        with pytest.raises(
            ReplicaSyncError, match=r"layer 'norm' \(SyncBatchNorm1d\(4\)\).*replica\(s\) \[1\]"
        ):
            parallel.data_parallel(model, torch.randn(6, 3), [4, 2])
    # The 1 s replica timeout, then (quiet) well under 4 s of work, at the load measured.
    assert time.monotonic() - start < 1.0 + load.margin(4.0), load
    # The failed step leaves nothing behind: the next one synchronises normally.
    ref = nn.BatchNorm1d(4)
    x = torch.randn(6, 3)
    y = parallel.data_parallel(model, x, [3, 3])
    assert_close(y, ref(model.lin(x)), "output after a failed step", 1e-5)


@pytest.mark.parametrize("failing_chunk", [0, 1])
def test_replica_that_raises_gives_its_error_at_once(failing_chunk) -> None:
    # The replica's own exception reaches the caller, whichever replica raised; the sibling
    # waiting at the layer stops at once, not after the replica timeout (long here: an ordering
    # that load cannot break).
    parallel.set_replica_timeout(LONG)
    sizes = [3, 3]
    sizes[failing_chunk] = 5
    start = time.monotonic()
    with pytest.raises(KeyError, match="replica failed before the layer") as raised:
        parallel.data_parallel(Branchy(boom=5), torch.randn(8, 3), sizes)
    assert time.monotonic() - start < LONG
    if hasattr(BaseException, "add_note"):  # Python 3.11+
        notes = getattr(raised.value, "__notes__", [])
        assert any(f"raised in replica {failing_chunk}; replica(s) [{1 - failing_chunk}]" in n for n in notes)


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_inside_the_replicas_is_a_prompt_clear_error(reentrant: bool) -> None:
    # On CPU every replica's backward runs in one thread, where the replicas' recomputations can
    # never meet: syncbn's error at once (the replica timeout and "never reached this layer"
    # before). A checkpoint around the whole model works (non-reentrant: statistics updated once).
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm1d(3).double()
    model = Checkpointed(nn.Sequential(Scale(3).double(), layer), reentrant)
    x = torch.randn(8, 3, 2, dtype=torch.float64, requires_grad=True)
    parallel.set_replica_timeout(LONG)  # at once, not after the replica timeout
    y = parallel.data_parallel(model, x, [3, 5])
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError, match="activation checkpointing recomputes replica"):
        y.backward(torch.randn_like(y))
    assert time.monotonic() - start < LONG
    if reentrant:
        return
    ref = nn.BatchNorm1d(3).double()
    ref.load_state_dict(layer.state_dict())
    layer.reset_running_stats()
    ref.reset_running_stats()
    g = torch.randn_like(x)
    x.grad = None
    checkpoint(lambda t: parallel.data_parallel(layer, t * 1.0, [3, 5]), x, use_reentrant=False).backward(g)
    xr = x.detach().clone().requires_grad_()
    ref(xr * 1.0).backward(g)
    assert_close(x.grad, xr.grad, "input grad")
    assert_close(layer.running_var, ref.running_var, "running_var")
    assert int(layer.num_batches_tracked) == 1


class Times(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * 1.0)  # (an in-place layer must not write over the scattered chunks)


@pytest.mark.parametrize("family", ["batchnorm", "renorm", "inplace"])
def test_a_reentrant_checkpoint_around_the_model_updates_statistics_once(family: str) -> None:
    # The recomputation runs in the replicas' threads, which cannot see the backward: the
    # replication made during a backward is one (statistics updated twice before, and renorm's
    # recomputation read the updated ones: wrong gradients). As the layer checkpointed alone.
    from torch.utils.checkpoint import checkpoint

    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = {
            "batchnorm": lambda: syncbn.SyncBatchNorm1d(3),
            "renorm": lambda: syncbn.SyncBatchRenorm1d(3, r_max=1.5, d_max=0.5),
            "inplace": lambda: syncbn.InPlaceSyncBatchNorm(3, activation="elu", activation_param=0.5),
        }[family]().double()
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.running_mean.uniform_(-1.0, 1.0)
            layer.running_var.uniform_(0.5, 2.0)
        return layer

    x = torch.randn(8, 3, 2, dtype=torch.float64) * 2 + 1
    g = torch.randn_like(x)
    results = []
    for chunks in (None, [3, 5]):
        layer = make()
        model = Times(layer)
        xx = x.clone().requires_grad_()
        run = model if chunks is None else (lambda t, m=model, c=chunks: parallel.data_parallel(m, t, c))
        checkpoint(run, xx, use_reentrant=True).backward(g)
        results.append([xx.grad, layer.weight.grad, *layer.buffers()])
    for name, a, b in zip(("dx", "dweight", "running_mean", "running_var", "batches"), *results):
        assert_close(a, b, name)


def test_eval_never_waits() -> None:
    model = Branchy(min_rows=2).eval()
    parallel.set_replica_timeout(LONG)  # a replica that waited would wait this long for the other
    start = time.monotonic()
    parallel.data_parallel(model, torch.randn(6, 3), [4, 2])
    assert time.monotonic() - start < LONG


def test_torch_replicate_is_recognised(monkeypatch) -> None:
    """torch.nn.parallel.replicate itself (its broadcast made CPU-only) enrols the replicas."""
    torch_replicate = importlib.import_module("torch.nn.parallel.replicate")

    def cpu_broadcast(tensors, devices, detach=False):
        copies = [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]
        return copies

    monkeypatch.setattr(torch_replicate, "_broadcast_coalesced_reshape", cpu_broadcast)
    model = nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4))
    for _ in range(2):  # a second replicate call makes a second, separate replication
        replicas = torch_replicate.replicate(model, [0, 1, 2])
        slots = [r[1].__dict__["_syncbn_replica"] for r in replicas]
        assert [s.index for s in slots] == [0, 1, 2]
        assert slots[0].replication is slots[2].replication and slots[0].replication.expected == 3
        x = torch.randn(9, 3)
        with torch.no_grad():
            y = torch.cat(parallel.parallel_apply(replicas, list(torch.split(x, [4, 4, 1]))))
            ref = nn.functional.batch_norm(model[0](x), None, None, training=True)
        assert_close(y, ref * model[1].weight + model[1].bias, "output", 1e-5)


def _cpu_torch_replicate(monkeypatch):
    """torch.nn.parallel.replicate with its device broadcast made CPU-only."""
    torch_replicate = importlib.import_module("torch.nn.parallel.replicate")

    def cpu_broadcast(tensors, devices, detach=False):
        return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]

    monkeypatch.setattr(torch_replicate, "_broadcast_coalesced_reshape", cpu_broadcast)
    return torch_replicate.replicate


def test_torch_replicate_after_forwards_that_never_synchronised(monkeypatch) -> None:
    """Replicas of earlier forwards (eval, or the layer skipped) are freed: they never join the next ones."""
    torch_replicate = _cpu_torch_replicate(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4)).eval()
    x = torch.randn(9, 3)
    for _ in range(2):  # as nn.DataParallel in eval: replicate, run, drop the replicas
        with torch.no_grad():
            parallel.parallel_apply(torch_replicate(model, [0, 1]), [x[:4], x[4:]])
    model.train()
    replicas = torch_replicate(model, [0, 1, 2])
    slots = [r[1].__dict__["_syncbn_replica"] for r in replicas]
    assert [s.index for s in slots] == [0, 1, 2] and slots[0].replication.expected == 3
    with torch.no_grad():
        y = torch.cat(parallel.parallel_apply(replicas, list(torch.split(x, [4, 4, 1]))))
        ref = nn.functional.batch_norm(model[0](x), None, None, training=True)
    assert_close(y, ref * model[1].weight + model[1].bias, "output", 1e-5)


def test_torch_replicate_twice_without_a_forward_keeps_the_calls_apart(monkeypatch) -> None:
    """Two live replica sets of a model with two layers: each layer's replicas of one call stay together."""
    torch_replicate = _cpu_torch_replicate(monkeypatch)
    model = nn.Sequential(syncbn.SyncBatchNorm1d(3), nn.Linear(3, 3), syncbn.SyncBatchNorm1d(3))
    first = torch_replicate(model, [0, 1])
    second = torch_replicate(model, [0, 1])
    for layer in (0, 2):
        a = [r[layer].__dict__["_syncbn_replica"] for r in first]
        b = [r[layer].__dict__["_syncbn_replica"] for r in second]
        assert a[0].replication is a[1].replication and b[0].replication is b[1].replication
        assert a[0].replication is not b[0].replication and b[0].replication.expected == 2
    x = torch.randn(8, 3)
    with torch.no_grad():
        y = torch.cat(parallel.parallel_apply(second, [x[:5], x[5:]]))
    assert_close(y, model(x), "output", 1e-5)


def test_torch_replicate_never_joins_live_replicas_of_an_earlier_call(monkeypatch) -> None:
    """One syncbn layer: replicas of a forward that failed before it (kept alive by the stored
    exception), or of a replicate call without a forward, never join the next call's replicas."""
    torch_replicate = _cpu_torch_replicate(monkeypatch)
    model = Branchy(boom=4)
    kept = []
    with pytest.raises(KeyError) as failed:  # every replica raises before the layer
        parallel.parallel_apply(torch_replicate(model, [0, 1]), [torch.randn(4, 3), torch.randn(4, 3)])
    kept.append(failed.value)
    unused = torch_replicate(model, [0, 1])
    replicas = torch_replicate(model, [0, 1])
    slots = [r.norm.__dict__["_syncbn_replica"] for r in replicas]
    assert [s.index for s in slots] == [0, 1] and slots[0].replication.expected == 2
    assert slots[0].replication is not unused[0].norm.__dict__["_syncbn_replica"].replication
    x = torch.randn(8, 3)
    with torch.no_grad():
        y = torch.cat(parallel.parallel_apply(replicas, [x[:5], x[5:]]))
        ref = nn.functional.batch_norm(model.lin(x), None, None, training=True)
    assert_close(y, ref * model.norm.weight + model.norm.bias, "output", 1e-5)


def test_replicas_made_without_replicate_join_until_the_first_forward() -> None:
    bn = syncbn.SyncBatchNorm1d(2)
    first = [bn._replicate_for_data_parallel() for _ in range(2)]
    for replica in first:
        replica.weight, replica.bias = bn.weight, bn.bias
    x = torch.randn(8, 2)
    outs = parallel.parallel_apply(first, [x[:5], x[5:]])
    assert_close(torch.cat(outs), nn.functional.batch_norm(x, None, None, training=True), "output", 1e-5)
    second = bn._replicate_for_data_parallel()
    assert (
        second.__dict__["_syncbn_replica"].replication is not first[0].__dict__["_syncbn_replica"].replication
    )


def test_ordered_sum_ignores_arrival_order() -> None:
    values = [
        torch.tensor([1e16], dtype=torch.float64),
        torch.tensor([1.0]).double(),
        torch.tensor([-1e16]).double(),
    ]
    rendezvous = Rendezvous(3, timeout=LONG)  # (never reached: all arrive within 40 ms)
    results: dict[int, torch.Tensor] = {}

    def member(k: int) -> None:
        time.sleep(0.02 * (2 - k))  # arrive in reverse order
        results[k] = ThreadSumGroup(rendezvous, k).all_reduce_sum(values[k].clone())

    threads = [threading.Thread(target=member, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = ordered_sum(values)  # (1e16 + 1) - 1e16 == 0 in float64; another order gives 1
    assert all(torch.equal(results[k], expected) for k in range(3))


def test_rendezvous_errors() -> None:
    rendezvous = Rendezvous(2, timeout=0.2, label="layer 'x'")
    with pytest.raises(ReplicaSyncError, match=r"layer 'x': replica 0 of 2 waited 0.2 s .* \[1\]"):
        rendezvous.exchange(0, 1, what="a")
    with pytest.raises(ReplicaSyncError, match="never reached"):  # broken for good
        rendezvous.exchange(1, 1, what="a")

    mismatch = Rendezvous(2, timeout=LONG, label="layer 'y'")  # the thread must arrive first
    errors: list[BaseException] = []

    def first() -> None:
        try:
            mismatch.exchange(0, 1, what="forward")
        except ReplicaSyncError as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.05)
    with pytest.raises(ReplicaSyncError, match="in different ways"):
        mismatch.exchange(1, 1, what="backward")
    t.join()
    assert errors and "in different ways" in str(errors[0])
    with pytest.raises(ValueError, match="positive timeout"):
        Rendezvous(2, timeout=0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        parallel.set_replica_timeout(-1)
    for huge in (float("inf"), 1e12):  # refused before anything changes, as syncbn.set_timeout does
        with pytest.raises(ValueError, match=r"expected at most 1e\+09 seconds, about 31 years \(got "):
            parallel.set_replica_timeout(huge)
    assert parallel.get_replica_timeout() == 20.0  # the fixture's
    unbounded = Rendezvous(2, timeout=float("inf"))  # a huge wait still works (in slices)
    late = threading.Timer(0.1, unbounded.exchange, (1, 2), {"what": "a"})
    late.start()
    assert unbounded.exchange(0, 1, what="a") == [1, 2]
    late.join()


def test_driver_argument_errors() -> None:
    model = syncbn.SyncBatchNorm1d(2)
    with pytest.raises(ValueError, match=r"summing to the batch size 4 \(got \[1, 2\]\)"):
        parallel.data_parallel(model, torch.randn(4, 2), [1, 2])
    with pytest.raises(ValueError, match="one input per replica"):
        parallel.parallel_apply([model], [torch.randn(2, 2), torch.randn(2, 2)])
    with pytest.raises(ValueError, match="at least 1"):
        parallel.replicate(model, 0)


def test_plain_data_parallel_without_gpus_is_batchnorm() -> None:
    torch.manual_seed(0)
    ours, ref = syncbn.SyncBatchNorm2d(4), nn.BatchNorm2d(4)
    x = torch.randn(6, 4, 3, 3)
    assert torch.equal(nn.DataParallel(ours)(x), ref(x))
    assert torch.equal(ours.running_var, ref.running_var)


# ----------------------------------------------------------------------------------------------
# CUDA: nn.DataParallel itself
# ----------------------------------------------------------------------------------------------


def cuda_check(device_ids: list[int], chunks_rows: int) -> None:
    torch.manual_seed(0)
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4, dtype=torch.float32)
    ours = ours.cuda(device_ids[0])
    dp = nn.DataParallel(ours, device_ids=device_ids)
    gen = torch.Generator().manual_seed(0)
    for training in (True, True, False, True):
        dp.train(training)
        ref.train(training)
        x = torch.randn(chunks_rows, 4, 5, 5, generator=gen)
        grad = torch.randn(chunks_rows, 4, 5, 5, generator=gen)
        ours.zero_grad()
        ref.zero_grad()
        x_ours = x.cuda(device_ids[0]).requires_grad_()
        x_ref = x.double().requires_grad_()
        y = dp(x_ours)
        y_ref = ref(x_ref)
        assert_close(y.cpu(), y_ref, "output", 1e-4)
        y.backward(grad.cuda(device_ids[0]))
        y_ref.backward(grad.double())
        assert_close(x_ours.grad.cpu(), x_ref.grad, "input grad", 1e-4)
        for p, p_ref in zip(ours.parameters(), ref.parameters()):
            assert_close(p.grad.cpu(), p_ref.grad, "param grad", 1e-4)
        for b, b_ref in zip(ours.buffers(), ref.buffers()):
            assert_close(b.cpu(), b_ref, "buffer", 1e-4)


@needs_cuda
def test_cuda_data_parallel_single_replica() -> None:
    cuda_check([0], 6)


@needs_cuda
def test_cuda_driver_replicas_on_one_gpu() -> None:
    ours, ref = make_pair(syncbn.SyncBatchNorm2d, nn.BatchNorm2d, 4, dtype=torch.float32)
    ours = ours.cuda()
    x = torch.randn(7, 4, 5, 5)
    y = parallel.data_parallel(ours, x.cuda(), [3, 0, 4])
    assert_close(y.cpu(), ref(x.double()), "output", 1e-4)


@needs_2_gpus
def test_cuda_data_parallel_all_devices() -> None:
    n = torch.cuda.device_count()
    cuda_check(list(range(n)), 3 * n + 1)  # uneven chunks


@needs_2_gpus
def test_cuda_data_parallel_missing_replica_is_bounded() -> None:
    model = Branchy(min_rows=2).cuda()
    dp = nn.DataParallel(model, device_ids=[0, 1])
    with pytest.raises(ReplicaSyncError, match="layer 'norm'"):
        dp(torch.randn(5, 3).cuda())  # chunks of 3 and 2 rows: replica 1 skips the layer
