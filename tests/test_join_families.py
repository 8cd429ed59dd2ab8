"""Join with uneven batches on every layer family, with and without debug mode.

``Join([JoinableSyncBatchNorm(ddp), ddp])`` on 2 gloo ranks holding 3 and 1
batches: every family must take the same Join policy (the per-call checks are
skipped under Join: the joinable's header checks agreement instead), so the
training rank never waits on a joined one. Results equal ``nn.BatchNorm`` (and
the activation) on the concatenation of the batches of the ranks still training,
float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import syncbn
from _helpers.compare import join_run
from _helpers.dist_harness import launch

# Batches per rank: rank 1 joins after its first step, or before any (so the layers' first use,
# with its handshake, happens under Join).
SCHEDULES = {"3-1": (3, 1), "2-0": (2, 0)}
FAMILIES = ("batchnorm", "inplace_abn", "renorm")


class _LeakyReLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, 0.01)


def _reference(family: str) -> nn.Sequential:
    torch.manual_seed(0)
    act: nn.Module = _LeakyReLU() if family == "inplace_abn" else nn.Identity()
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), act, nn.Linear(6, 2)).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    return model


def _ours(ref: nn.Sequential, family: str) -> nn.Sequential:
    model = copy.deepcopy(ref)
    bn = model[1]
    layer: nn.Module
    if family == "batchnorm":
        layer = syncbn.SyncBatchNorm1d(6, dtype=torch.float64)
    elif family == "inplace_abn":
        layer = syncbn.InPlaceSyncBatchNorm(6, dtype=torch.float64, activation="leaky_relu")
    else:
        # r_max=1, d_max=0: exactly BatchNorm, so nn.BatchNorm is the reference here too.
        layer = syncbn.SyncBatchRenorm1d(6, dtype=torch.float64, r_max=1.0, d_max=0.0)
    layer.load_state_dict(bn.state_dict())
    if family == "inplace_abn":
        with torch.no_grad():  # its scale is |weight| + eps: the same affine map as the reference's
            layer.weight.sub_(layer.eps)
    model[1] = layer
    if family == "inplace_abn":
        model[2] = nn.Identity()  # the layer applies the activation itself
    return model


def _batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 2 + rank
    x = torch.randn(n, 3, dtype=torch.float64, generator=g) * 2 + 1
    return x, torch.randn(n, 2, dtype=torch.float64, generator=g)


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _state_err(ours: nn.Module, ref: nn.Module) -> float:
    a, b = ours.state_dict(), ref.state_dict()
    if isinstance(ours[1], syncbn.InPlaceSyncBatchNorm):
        a["1.weight"] = a["1.weight"] + ours[1].eps
    return max(_err(a[k].double(), b[k].double()) for k in b)


def _run(rank: int, world_size: int, family: str, debug: bool, batches: tuple[int, int]) -> dict[str, Any]:
    syncbn.set_debug(debug)
    syncbn.set_timeout(8.0)
    ref = _reference(family)
    model = _ours(ref, family)
    syncbn.name_layers(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    joinable = syncbn.JoinableSyncBatchNorm(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def error(y: Tensor, y_ref: Tensor) -> float:
        return max(_err(y, y_ref), _state_err(model, ref))

    errors = join_run(ddp, joinable, opt, ref, ref_opt, _batch, batches, rank, error)
    return {"steps": errors, "final": _state_err(model, ref), "shadowed": joinable.shadowed}


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in FAMILIES:
        for debug in (False, True):
            for name, batches in SCHEDULES.items():
                out[f"{family}-{debug}-{name}"] = _run(rank, world_size, family, debug, batches)
    syncbn.set_debug(None)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_cases, 2, timeout=240)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("family", FAMILIES)
def test_join_uneven_batches_every_family(
    results: list[dict[str, Any]], family: str, debug: bool, schedule: str
) -> None:
    batches = SCHEDULES[schedule]
    for rank, per_rank in enumerate(results):
        result = per_rank[f"{family}-{debug}-{schedule}"]
        assert len(result["steps"]) == batches[rank]
        assert max(result["steps"], default=0.0) <= 1e-10, f"rank {rank}: {result['steps']}"
        assert result["final"] <= 1e-10, f"rank {rank}: final state {result['final']}"
        # 2 collectives per step (forward and backward) for each step the rank sat out.
        assert result["shadowed"] == 2 * (max(batches) - batches[rank]), f"rank {rank}"


def _explicit_groups(rank: int, world_size: int) -> dict[str, str]:
    from syncbn.compat.inplace_abn import InPlaceABN, InPlaceABNSync
    from syncbn.compat.sync_batchnorm import SynchronizedBatchNorm1d

    world = torch.distributed.group.WORLD
    layers: dict[str, nn.Module] = {
        "SyncBatchNorm1d": syncbn.SyncBatchNorm1d(4, process_group=world),
        "SyncBatchRenorm1d": syncbn.SyncBatchRenorm1d(4, process_group=world),
        "InPlaceSyncBatchNorm": syncbn.InPlaceSyncBatchNorm(4, process_group=world),
        "SynchronizedBatchNorm1d": SynchronizedBatchNorm1d(4, process_group=world),
        "InPlaceABNSync": InPlaceABNSync(4, group=world),
    }
    out = {}
    for name, layer in layers.items():
        try:
            syncbn.JoinableSyncBatchNorm(nn.Sequential(nn.Linear(3, 4), layer))
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    # The default group (None) and a layer that never synchronises are fine.
    syncbn.JoinableSyncBatchNorm(nn.Sequential(syncbn.InPlaceSyncBatchNorm(4), InPlaceABN(4)))
    out["default"] = "accepted"
    out["after a Join that raised"] = _after_a_join_that_raised(rank)
    return out


def _after_a_join_that_raised(rank: int) -> str:
    """A Join whose body raised runs no post-hooks: join mode must still end with it, so that
    later collectives are framed again (swapped layers raise the mismatch on every rank)."""
    import warnings

    from torch.distributed.algorithms import Join

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4), syncbn.SyncBatchNorm1d(4)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", syncbn.groups.UnboundedStepWarning)
        ddp = nn.parallel.DistributedDataParallel(model)
        x = torch.randn(4, 3, dtype=torch.float64)
        ddp(x).sum().backward()  # every layer known on every rank
        try:
            with Join([syncbn.JoinableSyncBatchNorm(ddp), ddp]):
                ddp(x).sum().backward()
                raise KeyError("a data error in the training loop")
        except KeyError:
            pass
    h = torch.randn(4, 4, dtype=torch.float64)
    try:
        for layer in (model[1], model[2]) if rank == 0 else (model[2], model[1]):
            layer(h)
    except syncbn.CollectiveError as exc:
        return f"CollectiveError mismatch={exc.mismatch}"
    return "no error"


def test_joinable_refuses_an_explicit_group_on_every_family_and_join_mode_ends_with_the_join() -> None:
    for per_rank in launch(_explicit_groups, 2, timeout=120):
        assert per_rank.pop("default") == "accepted"
        assert per_rank.pop("after a Join that raised") == "CollectiveError mismatch=True"
        for name, message in per_rank.items():
            assert message == (
                "JoinableSyncBatchNorm supports layers synchronising over the default group only; "
                f"1 layer(s) have process_group set (e.g. {name})"
            ), name
