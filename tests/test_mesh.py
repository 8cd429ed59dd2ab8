"""A ``DeviceMesh`` as the group: ``convert_sync_batchnorm(model, device_mesh=)``, ``process_group=mesh``.

One launch of 4 gloo ranks: a 2x2 mesh ``("dp", "tp")`` synchronised over ``"dp"`` (tensor-parallel
peers see the same samples), exact against ``nn.BatchNorm`` on each dp group's global batch in
float64 with random upstream gradients, tp peers bit-identical; HSDP's 2-D data-parallel mesh
``("dp_replicate", "dp_shard")`` exact over all 4 ranks; a 3-D mesh whose 2-D data-parallel submesh
is flattened into groups of 2 (made by syncbn, cached); layers holding a mesh pickled and
deep-copied; ranks passing meshes that do not partition the job refused alike on every rank.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import syncbn
from _helpers import torchvision_shim
from _helpers.dist_harness import launch_once
from syncbn import groups
from syncbn.groups import _mesh


def _lightning() -> Any:
    """``syncbn.lightning``, or None where Lightning is not installed.

    Imported by the launch (:func:`_results`) before it forks, so the ranks inherit it; not at
    collection, where every xdist worker would pay about 3 s of CPU for it.
    """
    try:
        torchvision_shim.install()
        import syncbn.lightning
    except ImportError:  # pragma: no cover - depends on what is installed
        return None
    return syncbn.lightning


pytestmark = pytest.mark.timeout(240)

TOL = 1e-10
C, SHAPE = 3, (3, 3, 4, 4)  # per shard: 3 samples of 3 channels, 4x4


def _shard(seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input shard ``index`` and its upstream gradient (float64; away from zero mean)."""
    gen = torch.Generator().manual_seed(1000 * seed + index)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64) * 2 + 3
    return x, torch.randn(SHAPE, generator=gen, dtype=torch.float64)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(C), nn.ReLU()).double()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
    return model


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training step of ``model`` (its first layer the BatchNorm): what it gives and what it changes."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    bn = model[0]
    assert x.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": bn.weight.grad.clone(),
        "db": bn.bias.grad.clone(),
        "mean": bn.running_mean.clone(),
        "var": bn.running_var.clone(),
        "nbt": bn.num_batches_tracked.clone(),
    }


def _run_cases(rank: int, world_size: int) -> dict[str, Any]:
    syncbn.set_timeout(20)  # a mistake here ends in seconds, not minutes
    out: dict[str, Any] = {}
    # 2x2 ("dp", "tp"): ranks (0, 1) and (2, 3) are tp peers; dp groups {0, 2} and {1, 3}.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    x, g = _shard(1, dp)  # tp peers: the same samples and upstream gradient
    model = syncbn.convert_sync_batchnorm(_model(), device_mesh=mesh["dp"])
    out["dp_type"] = type(model[0]).__name__
    out["dp"] = _step(model, x, g)
    out["dp_members"] = groups.group_ranks(_mesh.group_of(model[0].process_group))
    syncbn_lightning = _lightning()
    if syncbn_lightning is not None:  # Lightning's LayerSync plugin, given the mesh
        plugin = syncbn_lightning.SyncBatchNorm(device_mesh=mesh["dp"])
        out["dp_plugin"] = _step(plugin.apply(_model()), x, g)
    layer = syncbn.SyncBatchNorm2d(C, process_group=mesh["dp"]).double()  # a layer given a mesh
    layer.load_state_dict(_model()[0].state_dict())
    out["dp_layer"] = _step(nn.Sequential(layer, nn.ReLU()), x, g)

    # Copies keep the mesh; pickled and deep-copied layers train as the original, bit for bit.
    fresh = syncbn.convert_sync_batchnorm(_model(), device_mesh=mesh["dp"])
    copies = [copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))]
    out["copies_hold_a_mesh"] = [_mesh.is_mesh(c[0].process_group) for c in copies]
    first = _step(fresh, x, g)
    out["copies_equal"] = [all(torch.equal(first[k], v) for k, v in _step(c, x, g).items()) for c in copies]

    # HSDP's 2-D data-parallel mesh: statistics over all 4 ranks (the default group).
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    x4, g4 = _shard(2, rank)
    model = syncbn.convert_sync_batchnorm(_model(), device_mesh=hsdp["dp_replicate", "dp_shard"])
    out["hsdp"] = _step(model, x4, g4)
    out["hsdp_is_default"] = _mesh.group_of(hsdp) is dist.group.WORLD
    out["hsdp_whole"] = _step(syncbn.convert_sync_batchnorm(_model(), process_group=hsdp), x4, g4)

    # 3-D (dp_replicate, dp_shard, tp) = (2, 1, 2): the 2-D data-parallel submesh is flattened into
    # groups {0, 2} and {1, 3}, made by syncbn on every rank, cached for any mesh object of that shape.
    three = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    sub = three["dp_replicate", "dp_shard"]
    replica = sub.get_coordinate()
    assert replica is not None
    x3, g3 = _shard(3, replica[0])
    made_before = dict(_mesh._made)
    model = syncbn.convert_sync_batchnorm(_model(), device_mesh=sub)
    out["three"] = _step(model, x3, g3)
    group = _mesh.group_of(sub)
    out["three_members"] = dist.get_process_group_ranks(group)
    again = three["dp_replicate", "dp_shard"]  # another object, the same partition: the same group
    out["three_cached"] = _mesh.group_of(again) is group and len(_mesh._made) == len(made_before) + 1

    # Meshes that do not partition the job: ranks 0 and 1 give the flattened (2, 1, 2) submesh
    # (members {0, 2} and {1, 3}), ranks 2 and 3 the whole 2x2 mesh. Refused on every rank alike.
    # (Mesh objects no rank resolved before: every rank meets; else the ranks holding a resolved one
    # go on to the collective and the others' meeting ends at syncbn's bound instead.)
    fresh_sub = three["dp_replicate", "dp_shard"]
    odd = syncbn.SyncBatchNorm2d(C, process_group=fresh_sub if rank < 2 else mesh).double()
    stats = (odd.running_mean.clone(), odd.running_var.clone())
    try:
        odd(x.clone())
        out["odd"] = None
    except ValueError as exc:
        out["odd"] = str(exc)
    out["odd_unchanged"] = torch.equal(stats[0], odd.running_mean) and torch.equal(stats[1], odd.running_var)
    check = torch.ones(1)
    dist.all_reduce(check)  # the default group is still usable
    out["usable"] = check.item()
    return out


def _results() -> list[dict[str, Any]]:
    _lightning()  # imported before the ranks fork (they inherit it)
    return launch_once(_run_cases, 4, timeout=200)


def _reference(xs: list[torch.Tensor], gs: list[torch.Tensor]) -> dict[str, Any]:
    """``nn.BatchNorm2d`` (+ ReLU) on the concatenated batch: per-shard outputs and input gradients."""
    ref = _model()
    x = torch.cat(xs).requires_grad_()
    y = ref(x)
    y.backward(torch.cat(gs))
    bn = ref[0]
    n = SHAPE[0]
    return {
        "y": list(y.detach().split(n)),
        "dx": list(x.grad.split(n)),  # type: ignore[union-attr]
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "mean": bn.running_mean,
        "var": bn.running_var,
        "nbt": bn.num_batches_tracked,
    }


def _worst(got: list[dict[str, torch.Tensor]], shards: list[int], ref: dict[str, Any]) -> float:
    """Largest error of the ranks ``got`` (holding shards ``shards``) against ``ref``."""
    errors = [0.0]
    for result, shard in zip(got, shards):
        errors += [(result[k] - ref[k][shard]).abs().max().item() for k in ("y", "dx")]
        errors += [(result[k] - ref[k]).abs().max().item() for k in ("mean", "var")]
        assert torch.equal(result["nbt"], ref["nbt"])
    for k in ("dw", "db"):  # local gradients: their sum over the group is the big batch's
        errors.append((sum(r[k] for r in got) - ref[k]).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("key", ["dp", "dp_layer", "dp_plugin"])
def test_a_2x2_mesh_synchronises_over_dp_exactly_and_tp_peers_are_bit_identical(key: str) -> None:
    if key == "dp_plugin" and _lightning() is None:
        pytest.skip("Lightning is not installed")
    results = _results()
    xs, gs = zip(*(_shard(1, i) for i in range(2)))
    ref = _reference(list(xs), list(gs))
    for group in ([0, 2], [1, 3]):  # each dp group's global batch: dp shards 0 and 1
        assert _worst([results[r][key] for r in group], [0, 1], ref) < TOL
    for a, b in ((0, 1), (2, 3)):  # tp peers
        assert all(torch.equal(results[a][key][k], results[b][key][k]) for k in results[a][key])
    assert results[0]["dp_type"] == "SyncBatchNorm2d"
    assert [r["dp_members"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_hsdps_2d_data_parallel_mesh_synchronises_over_all_its_ranks() -> None:
    results = _results()
    xs, gs = zip(*(_shard(2, i) for i in range(4)))
    ref = _reference(list(xs), list(gs))
    for key in ("hsdp", "hsdp_whole"):
        assert _worst([r[key] for r in results], [0, 1, 2, 3], ref) < TOL, key
    assert all(r["hsdp_is_default"] for r in results)


def test_a_multi_dimensional_submesh_is_flattened_once_on_every_rank() -> None:
    results = _results()
    xs, gs = zip(*(_shard(3, i) for i in range(2)))
    ref = _reference(list(xs), list(gs))
    for group in ([0, 2], [1, 3]):  # replicas 0 and 1 of each flattened group
        assert _worst([results[r]["three"] for r in group], [0, 1], ref) < TOL
        assert all(results[r]["three_members"] == group for r in group)
    assert all(r["three_cached"] for r in results)


def test_layers_holding_a_mesh_pickle_and_deep_copy() -> None:
    for result in _results():
        assert result["copies_hold_a_mesh"] == [True, True]
        assert result["copies_equal"] == [True, True]


def test_meshes_that_do_not_partition_the_job_are_refused_on_every_rank() -> None:
    results = _results()
    for result in results:
        text = result["odd"]
        assert text is not None and "expected every rank of the job to pass a DeviceMesh" in text
        assert "rank 0: [0, 2]" in text and "rank 2: [0, 1, 2, 3]" in text and "No group was made" in text
        assert result["odd_unchanged"] and result["usable"] == 4.0
    # Each rank names its own mesh, then the same finding on every rank.
    assert len({r["odd"].split(": expected", 1)[1] for r in results}) == 1


def test_device_mesh_argument_errors_name_what_was_expected() -> None:
    model = nn.Sequential(nn.BatchNorm2d(2))
    with pytest.raises(
        TypeError, match="expected device_mesh to be a torch.distributed.device_mesh.DeviceMesh"
    ):
        syncbn.convert_sync_batchnorm(model, device_mesh="dp")
    assert type(model[0]) is nn.BatchNorm2d  # nothing converted
    mesh = object.__new__(torch.distributed.device_mesh.DeviceMesh)  # the type check only
    with pytest.raises(ValueError, match="expected one of device_mesh, process_group and group_size"):
        syncbn.convert_sync_batchnorm(model, group_size=2, device_mesh=mesh)
    assert type(model[0]) is nn.BatchNorm2d
    # Outside torch.distributed a layer holding a mesh is plain BatchNorm, as with any group.
    assert groups.resolve(mesh) is None
