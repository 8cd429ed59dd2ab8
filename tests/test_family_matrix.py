"""Every layer family on every path, against its float64 reference on the global batch.

The matrix is family x path (eager under a process group, ``torch.compile``, DDP, DataParallel
replicas) x dtype (float64, float32) x per-rank batches (uneven, one rank empty), two training
steps each with an SGD step between them, plus DDP under ``Join`` (ranks holding 3 and 1
batches, debug checks on and off). A family is one entry of :data:`FAMILIES`: how to build its
synchronised layer and its reference module (plain torch, float64, same ``state_dict`` keys);
every case then runs for it. A case a family fails today is listed in :data:`KNOWN_FAILURES`
with the reason (``xfail``, not strict) and leaves the list with the fix.

The distributed paths run in one launch of 2 gloo ranks for the whole module; each test reads
its case from that launch. DataParallel runs in this process (replica threads on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms import Join

import _helpers.compiling  # noqa: F401  (the compiler's modules, inherited by the forked ranks)
import syncbn
from _helpers.abn_reference import max_error
from _helpers.dist_harness import launch_once
from _helpers.marks import HAS_COMPILED_OPS, needs_compiled_ops
from _helpers.modules import CountingGroup, Scale
from _helpers.renorm_reference import EPS, renorm_reference

pytestmark = pytest.mark.timeout(900)  # the one launch of the matrix: 280 s, stretched by load up to 3x

WORLD = 2
CHANNELS = 4
LENGTH = 3  # inputs are (N, CHANNELS, LENGTH)
STEPS = 2
LR = 0.1


class _InPlaceReference(nn.BatchNorm1d):
    """BatchNorm with weight ``|w| + eps``, then the activation: the in-place family's math."""

    def __init__(self, channels: int, activation: Callable[[Tensor], Tensor]) -> None:
        super().__init__(channels)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight.abs() + self.eps,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
        return self.activation(y)


class _RenormReference(nn.BatchNorm1d):
    """Batch Renormalization's formulas on the whole batch (the renorm family's math).

    ``r = clamp(s_B / s, 1/r_max, r_max)`` and ``d = clamp((mean_B - running_mean) / s, -d_max,
    d_max)`` from the running statistics before this step's update, both constants in backward;
    then BatchNorm's running update.
    """

    def __init__(self, channels: int, r_max: float = 1.5, d_max: float = 0.4) -> None:
        super().__init__(channels)
        self.r_max, self.d_max = r_max, d_max

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked.add_(1)
        assert self.eps == EPS and self.momentum == 0.1  # the formulas' constants
        y, new_mean, new_var = renorm_reference(
            x, self.weight, self.bias, self.running_mean, self.running_var, self.r_max, self.d_max
        )
        with torch.no_grad():
            self.running_mean.copy_(new_mean)
            self.running_var.copy_(new_var)
        return y


@dataclass(frozen=True)
class Family:
    """One layer family: its synchronised layer and the plain-torch module it must equal.

    Attributes:
        layer: builds the synchronised layer for ``(N, C, L)`` inputs from the channel count and
            a ``process_group`` keyword (``None``: the default group).
        reference: builds the reference (float64 after ``.double()``), whose ``state_dict``
            keys are the layer's: the test loads the layer's state into it.
    """

    layer: Callable[..., nn.Module]
    reference: Callable[[int], nn.Module]


FAMILIES: dict[str, Family] = {
    "batchnorm": Family(syncbn.SyncBatchNorm1d, nn.BatchNorm1d),
    "inplace_abn": Family(
        lambda c, **kw: syncbn.InPlaceSyncBatchNorm(c, activation="elu", activation_param=0.6, **kw),
        lambda c: _InPlaceReference(c, lambda t: F.elu(t, 0.6)),
    ),
    "renorm": Family(
        lambda c, **kw: syncbn.SyncBatchRenorm1d(c, r_max=1.5, d_max=0.4, **kw),
        lambda c: _RenormReference(c, r_max=1.5, d_max=0.4),
    ),
}

# Cases known to fail today, (family, case) -> reason, marked xfail (not strict) until fixed. A case is
# a path ("eager", "compiled", "ddp", "data_parallel") or "join" / "join-debug".
KNOWN_FAILURES: dict[tuple[str, str], str] = {}

DTYPES = {"float64": (torch.float64, 1e-10), "float32": (torch.float32, 1e-4)}
BATCHES = {"uneven": (3, 5), "empty": (4, 0)}  # per-rank batch sizes (every step)
DIST_PATHS = ("eager", "compiled", "ddp")


def _param(family: str, case: str, *values: Any, marks: tuple[Any, ...] = ()) -> Any:
    """``pytest.param(family, *values)`` with id ``family-case``, xfail where :data:`KNOWN_FAILURES` says."""
    reason = KNOWN_FAILURES.get((family, case))
    known = (pytest.mark.xfail(strict=False, reason=reason),) if reason else ()
    return pytest.param(family, *values, marks=(*marks, *known), id=f"{family}-{case}")


def _models(family: str, dtype: torch.dtype, group: Any = None) -> tuple[nn.Module, nn.Module]:
    """The model under test in ``dtype`` (its layer over ``group``) and its float64 reference."""
    fam = FAMILIES[family]
    torch.manual_seed(0)
    ours = nn.Sequential(Scale(CHANNELS), fam.layer(CHANNELS, process_group=group))
    with torch.no_grad():
        ours[1].weight.uniform_(0.5, 1.5)
        ours[1].weight[0] *= -1  # a negative weight
        ours[1].bias.uniform_(-0.5, 0.5)
    ours = ours.to(dtype)
    ref = nn.Sequential(Scale(CHANNELS), fam.reference(CHANNELS)).double()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _data(step: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A global batch (large mean) and upstream gradient, rounded to ``dtype``, held in float64."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(n, CHANNELS, LENGTH, generator=g, dtype=torch.float64) * 2.0 + 3.0
    grad = torch.randn(n, CHANNELS, LENGTH, generator=g, dtype=torch.float64)
    return x.to(dtype).double(), grad.to(dtype).double()


def _ref_step(ref: nn.Module, opt: torch.optim.Optimizer, x: Tensor, grad: Tensor, div: float = 1.0) -> Any:
    """One reference step on the global batch: output, input gradient, parameter gradients."""
    leaf = x.clone().requires_grad_()
    y = ref(leaf)
    (y * grad).sum().div(div).backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    opt.step()
    opt.zero_grad()
    return y.detach(), leaf.grad, grads


def _state_error(ours: nn.Module, ref: nn.Module) -> float:
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)
    return max(max_error(mine[k].double(), theirs[k]) for k in theirs)


def _train(family: str, path: str, dtype: torch.dtype, sizes: tuple[int, ...], rank: int) -> dict[str, float]:
    """``STEPS`` steps of the model on one path against the reference on the global batch.

    Returns the largest error of each quantity and step (relative to max(1, |reference|)); on the
    eager path also ``collectives``: 0 when every step made one collective each way, sized by the
    channels (``2C + 1`` values forward, ``2C`` backward), else the number of steps that did not.
    """
    group = CountingGroup() if path == "eager" else None
    ours, ref = _models(family, dtype, group)
    if path == "ddp":
        run: nn.Module = nn.parallel.DistributedDataParallel(ours)
    elif path == "compiled":
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(ours, backend="aot_eager")
    else:
        run = ours
    opt = torch.optim.SGD(ours.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    n, lo = sum(sizes), sum(sizes[:rank])
    # DataParallel runs in one process: the whole batch, split into replicas of ``sizes``.
    shard = slice(0, n) if path == "data_parallel" else slice(lo, lo + sizes[rank])
    errors: dict[str, float] = {}
    for step in range(STEPS):
        x, grad = _data(step, n, dtype)
        y_ref, dx_ref, grads_ref = _ref_step(ref, ref_opt, x, grad)
        leaf = x[shard].to(dtype).requires_grad_()
        y = syncbn.parallel.data_parallel(run, leaf, list(sizes)) if path == "data_parallel" else run(leaf)
        y.backward(grad[shard].to(dtype))
        for p in ours.parameters():
            if path == "ddp":
                p.grad.mul_(WORLD)  # DDP averages the ranks' shares
            elif path != "data_parallel":
                dist.all_reduce(p.grad)  # weight gradients stay local: sum them as DDP would
        grads = [p.grad.double() for p in ours.parameters()]
        errors[f"y{step}"] = max_error(y, y_ref[shard])
        errors[f"dx{step}"] = max_error(leaf.grad, dx_ref[shard])
        errors[f"grads{step}"] = max(max_error(a, b) for a, b in zip(grads, grads_ref))
        opt.step()
        opt.zero_grad()
        errors[f"state{step}"] = _state_error(ours, ref)
        if group is not None:
            errors["collectives"] = errors.get("collectives", 0.0) + float(
                group.calls != [2 * CHANNELS + 1, 2 * CHANNELS]
            )
            group.calls.clear()
    if path == "compiled":
        errors["graph breaks"] = float(sum(counters["graph_break"].values()))
    return errors


def _case_id(family: str, path: str, dtype: str, batches: str) -> str:
    return f"{family}-{path}-{dtype}-{batches}"


def _dist_matrix(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in FAMILIES:
        for path in DIST_PATHS:
            if path == "compiled" and not HAS_COMPILED_OPS:
                continue
            for dname, (dtype, _) in DTYPES.items():
                for bname, sizes in BATCHES.items():
                    out[_case_id(family, path, dname, bname)] = _train(family, path, dtype, sizes, rank)
    return out


@pytest.mark.parametrize("batches", list(BATCHES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "family, path",
    [
        _param(f, p, p, marks=(needs_compiled_ops,) if p == "compiled" else ())
        for f in FAMILIES
        for p in DIST_PATHS
    ],
)
def test_two_ranks_equal_the_reference_on_the_global_batch(
    family: str, path: str, dtype: str, batches: str
) -> None:
    tol = DTYPES[dtype][1]
    results = launch_once(_dist_matrix, WORLD, timeout=280)
    for rank, per_rank in enumerate(results):
        errors = per_rank[_case_id(family, path, dtype, batches)]
        assert errors.pop("graph breaks", 0.0) == 0.0, f"rank {rank}: graph breaks"
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= tol, f"rank {rank}: {worst} error {errors[worst]:.3g} > {tol:.0g}: {errors}"


@pytest.mark.parametrize("batches", list(BATCHES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", [_param(f, "data_parallel") for f in FAMILIES])
def test_data_parallel_replicas_equal_the_reference_on_the_whole_batch(
    family: str, dtype: str, batches: str, short_replica_timeout: float
) -> None:
    errors = _train(family, "data_parallel", DTYPES[dtype][0], BATCHES[batches], 0)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= DTYPES[dtype][1], f"{worst}: {errors}"


JOIN_BATCHES = (3, 1)  # batches per rank: rank 1 joins after its first step


def _join(rank: int, world_size: int, family: str, debug: bool) -> dict[str, Any]:
    """DDP under ``Join([JoinableSyncBatchNorm(ddp), ddp])`` against the reference on the active ranks."""
    syncbn.set_debug(debug)
    syncbn.set_timeout(5.0)  # a rank left waiting fails in seconds (the known in-place failure included)
    ours, ref = _models(family, torch.float64)
    ddp = nn.parallel.DistributedDataParallel(ours)
    joinable = syncbn.JoinableSyncBatchNorm(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    def reference_step(step: int) -> Tensor:
        active = [r for r in range(world_size) if step < JOIN_BATCHES[r]]
        sizes = [2 + (r + step) % 2 for r in active]
        x, grad = _data(step, sum(sizes), torch.float64, seed=1)
        # DDP divides by the initial world size; a joined rank contributes zero gradients.
        y, _, _ = _ref_step(ref, ref_opt, x, grad, div=world_size)
        i = active.index(rank) if rank in active else 0
        return x, grad, slice(sum(sizes[:i]), sum(sizes[: i + 1])), y

    errors: list[float] = []
    with Join([joinable, ddp]):
        for step in range(JOIN_BATCHES[rank]):
            x, grad, shard, y_ref = reference_step(step)
            y = ddp(x[shard])
            (y * grad[shard]).sum().backward()
            opt.step()
            opt.zero_grad()
            errors.append(max(max_error(y, y_ref[shard]), _state_error(ours, ref)))
    for step in range(JOIN_BATCHES[rank], max(JOIN_BATCHES)):  # the steps the other rank still trained
        reference_step(step)
    return {"steps": errors, "final": _state_error(ours, ref)}


@pytest.mark.parametrize(
    "family, debug",
    [_param(f, "join-debug" if debug else "join", debug) for f in FAMILIES for debug in (True, False)],
)
def test_join_with_3_and_1_batches(family: str, debug: bool) -> None:
    results = launch_once(_join, WORLD, family, debug, timeout=60)
    for rank, result in enumerate(results):
        assert len(result["steps"]) == JOIN_BATCHES[rank]
        assert max(result["steps"] + [result["final"]]) <= 1e-12, f"rank {rank}: {result}"
