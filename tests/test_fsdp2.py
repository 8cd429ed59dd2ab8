"""FSDP2 (``fully_shard``) with a ``MixedPrecisionPolicy`` on 2 gloo ranks, every family.

One launch of 2 ranks runs every case. Each layer (``SyncBatchNorm2d``, ``SyncBatchRenorm2d``,
``InPlaceSyncBatchNorm2d``) is sharded by ``fully_shard`` under bf16 and fp16 parameters (and bf16
with ``reduce_dtype=torch.float32``) and trained two steps on uneven per-rank batches; its output,
input gradient, weight/bias gradients and eval output are compared with the float64 reference on
the global batch, computed from the same low-precision input, upstream gradient and parameters
(so the error measured is syncbn's arithmetic and FSDP's reduction, not the inputs' rounding).

Tolerance: ``|got - ref|_inf <= K * eps * scale`` with ``eps`` the low precision's machine epsilon
(``torch.finfo``: 2**-7 for bfloat16, 2**-10 for float16) and ``scale`` the reference's largest
magnitude; for the weight/bias gradients, the largest per-channel sum of the ranks' shares' magnitudes
(what FSDP's low-precision reduce-scatter rounds). Rounding a result to the low precision once costs
up to ``eps / 2`` of its magnitude (the statistics are float32, their error is negligible); a
weight/bias gradient is rounded twice (each rank's share in the parameter dtype, then the reduction
in that dtype). ``K = 2`` bounds that with margin; the measured maxima (9 cases, 2 ranks, 2 steps)
are 0.45 units for outputs and input gradients, 0.60 for weight/bias gradients, 0.41 in eval.
Running statistics stay float32 (their own dtype), within ``K_STATS = 4`` float32 units of the
float64 reference (measured: 0.91) and bit for bit equal across ranks.

``nn.BatchNorm2d`` in the same set-up fails in its first forward (bf16/fp16 weight beside float32
running statistics: torch's kernel takes a 16-bit input with float32 parameters, not 16-bit
parameters with float32 statistics); the test asserts it still raises, so a torch fix shows here.
The no-group path (one process, bf16 parameters beside float32 buffers, as FSDP makes them), eager
and compiled, trains and evaluates within the same tolerance (it used to raise nn.BatchNorm2d's error).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.nn.functional as F
from torch import nn

import _helpers.preload  # noqa: F401  (what the forked ranks import: imported once, here)
import syncbn
from _helpers.abn_reference import reference
from _helpers.dist_harness import launch_once
from _helpers.renorm_reference import renorm_reference

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not hasattr(fsdp, "fully_shard") or not hasattr(fsdp, "MixedPrecisionPolicy"),
        reason=f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)",
    ),
]

WORLD = 2
SIZES = (3, 5)  # uneven per-rank batches
C, H, W = 4, 3, 3
R_MAX, D_MAX = 1.5, 0.4  # renorm's clamps, active on these batches
SLOPE = 0.01  # the in-place layer's leaky_relu
STEPS = 2
K = 2.0  # units of the low precision's eps times the value scale (module docstring)
K_STATS = 4.0  # units of float32's eps times the value scale: the running statistics (two roundings)
FAMILIES = ("batchnorm", "renorm", "inplace")
POLICIES: dict[str, dict[str, torch.dtype]] = {
    "bf16": {"param_dtype": torch.bfloat16},
    "fp16": {"param_dtype": torch.float16},
    "bf16-reduce-fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
}


def _layer(family: str) -> nn.Module:
    if family == "renorm":
        return syncbn.SyncBatchRenorm2d(C, r_max=R_MAX, d_max=D_MAX)
    if family == "inplace":
        return syncbn.InPlaceSyncBatchNorm2d(C, activation="leaky_relu", activation_param=SLOPE)
    return syncbn.SyncBatchNorm2d(C)


def _reference(
    family: str, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rm: Any, rv: Any
) -> Any:
    """Float64 output, input/weight/bias gradients and new running statistics on the global batch."""
    if family != "renorm":
        inplace = family == "inplace"
        act, param = ("leaky_relu", SLOPE) if inplace else ("identity", 0.0)
        ref = reference(x, g, w, b, (rm, rv), activation=act, param=param, abs_weight=inplace)
        return ref["y"], ref["dx"], ref["dw"], ref["db"], ref["rm"], ref["rv"]
    x, w, b = (t.detach().double().requires_grad_() for t in (x, w, b))
    y, new_rm, new_rv = renorm_reference(x, w, b, rm, rv, R_MAX, D_MAX)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad, new_rm, new_rv


def _eval_reference(
    family: str, x: torch.Tensor, layer: nn.Module, w: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """Eval: the layer's own running statistics, float64 (renorm's eval is batch norm's)."""
    rm, rv = layer.running_mean.double(), layer.running_var.double()
    scale = w.abs() + layer.eps if family == "inplace" else w
    y = F.batch_norm(x, rm, rv, scale, b, False, 0.0, layer.eps)
    return F.leaky_relu(y, SLOPE) if family == "inplace" else y


def _units(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> float:
    """``|got - ref|_inf`` in units of ``eps(dtype) * |scale|_inf`` (``scale``: ``ref`` unless given)."""
    unit = (ref if scale is None else scale).abs().max().item() * torch.finfo(dtype).eps
    return (got.detach().double() - ref.double()).abs().max().item() / unit


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Copy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _layer_case(rank: int, mesh: Any, family: str, policy: str, seed: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = POLICIES[policy]["param_dtype"]
    gen = torch.Generator().manual_seed(seed)
    layer = _layer(family)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(C, generator=gen) + 0.5)
        layer.bias.copy_(torch.randn(C, generator=gen))
    # What FSDP computes with: the parameters cast to the low precision, as float64 for the reference.
    w64, b64 = (p.detach().to(low).double() for p in (layer.weight, layer.bias))
    # The unit's input reaches the layer through an operation of the unit, as in a real block: FSDP
    # hands a unit its input as a view made by its own autograd Function, which no layer may write
    # over (test_an_in_place_layer_first_in_a_unit_is_refused_as_nn_relu_inplace_is).
    unit = nn.Sequential(_Copy(), layer)
    fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICIES[policy]))
    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    rm64, rv64 = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    units: dict[str, float] = {}
    for _ in range(STEPS):
        # The global batch and upstream gradient, rounded to the low precision (held in float32:
        # FSDP casts the forward input, so the layer's input is a non-leaf it may overwrite).
        x = (torch.randn(sum(SIZES), C, H, W, generator=gen, dtype=torch.float64) * 1.5 + 3.0).to(low)
        g = torch.randn(sum(SIZES), C, H, W, generator=gen, dtype=torch.float64).to(low)
        x_local = x[start:stop].float().requires_grad_()
        y = unit(x_local)
        y.backward(g[start:stop])
        # Each rank's share of the weight/bias gradients (linear in g: g kept on that rank's rows),
        # whose magnitudes, not their sum's, set the rounding of FSDP's low-precision reduction.
        shares = torch.zeros(2, C, dtype=torch.float64)
        for r in range(WORLD):
            g_r = torch.zeros_like(g, dtype=torch.float64)
            lo, hi = sum(SIZES[:r]), sum(SIZES[: r + 1])
            g_r[lo:hi] = g[lo:hi].double()
            _, _, dw_r, db_r, _, _ = _reference(family, x.double(), g_r, w64, b64, rm64.clone(), rv64.clone())
            shares += torch.stack([dw_r, db_r]).abs()
        y_ref, dx_ref, dw_ref, db_ref, rm64, rv64 = _reference(
            family, x.double(), g.double(), w64, b64, rm64, rv64
        )
        # FSDP averages the ranks' weight gradients; syncbn's sum over ranks is the big-batch one.
        dw, db = (_full(p.grad) * WORLD for p in (layer.weight, layer.bias))
        for name, got, ref, scale in (
            ("y", y, y_ref[start:stop], None),
            ("dx", x_local.grad, dx_ref[start:stop], None),
            ("dw", dw, dw_ref, shares[0]),
            ("db", db, db_ref, shares[1]),
        ):
            units[name] = max(units.get(name, 0.0), _units(got, ref, low, scale))
        units["out_dtype_ok"] = float(y.dtype == low)
        layer.zero_grad()
    param_dtypes = {p.dtype for p in unit.parameters()}  # resharded after backward: the sharded ones
    units["rm"] = _units(layer.running_mean, rm64, torch.float32)
    units["rv"] = _units(layer.running_var, rv64, torch.float32)
    unit.eval()
    x_local = x[start:stop].float()
    units["eval"] = _units(
        unit(x_local), _eval_reference(family, x[start:stop].double(), layer, w64, b64), low
    )
    return {
        "units": units,
        "stats": [layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone()],
        "param_dtypes": param_dtypes,
    }


def _model(family: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(SLOPE),
        nn.Conv2d(8, C, 1),
        nn.BatchNorm2d(C),
    )
    if family == "renorm":
        return syncbn.convert_to_renorm(model, r_max=R_MAX, d_max=D_MAX)
    if family == "inplace":
        return syncbn.fuse_batchnorm_activation(syncbn.convert_sync_batchnorm(model))
    return model if family is None else syncbn.convert_sync_batchnorm(model)


def _shard(model: nn.Module, mesh: Any, low: torch.dtype) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=low)
    for sub in model:  # the convolutions as units of their own, the norm layers in the root's
        if isinstance(sub, nn.Conv2d):
            fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _training_case(rank: int, mesh: Any, family: str) -> dict[str, Any]:
    """A converted conv model under bf16 parameters: SGD steps, global loss, the statistics."""
    model = _model(family)
    _shard(model, mesh, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(SIZES), 3, 6, 6, generator=gen)
    target = torch.randn(sum(SIZES), C, 6, 6, generator=gen)
    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    losses = []
    for _ in range(4):
        loss = F.mse_loss(model(x[start:stop]).float(), target[start:stop], reduction="mean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    params = {
        name: (p.dtype, bool(_full(p.detach()).isfinite().all())) for name, p in model.named_parameters()
    }
    return {"losses": losses, "buffers": buffers, "params": params}


def _plain_failure(rank: int, mesh: Any, low: torch.dtype) -> str:
    """``nn.BatchNorm2d`` under the same policy: the error its first forward raises."""
    model = _model(None)
    _shard(model, mesh, low)
    try:
        model(torch.randn(SIZES[rank], 3, 6, 6))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _first_in_unit(rank: int, mesh: Any) -> list[str]:
    """An in-place layer, then torch's ``nn.ReLU(inplace=True)``, as the first layer of a unit."""
    from torch.distributed.fsdp import fully_shard

    messages = []
    for first in (_layer("inplace"), nn.ReLU(inplace=True)):
        unit = nn.Sequential(first, nn.Conv2d(C, C, 1))
        fully_shard(unit, mesh=mesh)
        try:
            unit(torch.randn(SIZES[rank], C, H, W, requires_grad=True) * 1.0)
            messages.append("no error")
        except RuntimeError as exc:
            messages.append(str(exc))
    return messages


def _run_all(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for i, family in enumerate(FAMILIES):
        for j, policy in enumerate(POLICIES):
            out[f"layer-{family}-{policy}"] = _layer_case(rank, mesh, family, policy, 100 + 10 * i + j)
        out[f"train-{family}"] = _training_case(rank, mesh, family)
    out["first-in-unit"] = _first_in_unit(rank, mesh)
    for low in (torch.bfloat16, torch.float16):
        out[f"plain-{low}"] = _plain_failure(rank, mesh, low)
    return out


def _results() -> list[dict[str, Any]]:
    return launch_once(_run_all, WORLD, timeout=240)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_sharded_layer_is_within_low_precision_rounding_of_float64_on_the_global_batch(
    family: str, policy: str
) -> None:
    results = [r[f"layer-{family}-{policy}"] for r in _results()]
    for rank, res in enumerate(results):
        units = res["units"]
        assert units.pop("out_dtype_ok") == 1.0, f"rank {rank}: output not in the param dtype"
        for name in ("y", "dx", "dw", "db", "eval"):
            assert units[name] <= K, f"rank {rank} {name}: {units[name]:.3f} eps units > {K}"
        for name in ("rm", "rv"):
            assert units[name] <= K_STATS, f"rank {rank} {name}: {units[name]:.3f} float32 eps units"
        # The sharded parameters keep their dtype; the running statistics keep theirs.
        assert res["param_dtypes"] == {torch.float32}
        rm, rv, seen = res["stats"]
        assert rm.dtype == rv.dtype == torch.float32 and seen.item() == STEPS
    for a, b in zip(results[0]["stats"], results[1]["stats"]):
        assert torch.equal(a, b), "running statistics differ across ranks"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_trains_under_bf16_parameters_with_float32_statistics_equal_on_every_rank(
    family: str,
) -> None:
    results = [r[f"train-{family}"] for r in _results()]
    losses = results[0]["losses"]
    assert results[1]["losses"] == losses, "ranks disagree on the global loss"
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    for res in results:
        params = res["params"]
        assert all(dtype == torch.float32 and finite for dtype, finite in params.values()), params
    buffers = [r["buffers"] for r in results]
    assert buffers[0].keys() == buffers[1].keys() and buffers[0]
    for name, value in buffers[0].items():
        expected = torch.int64 if name.endswith("num_batches_tracked") else torch.float32
        assert value.dtype == expected, (name, value.dtype)
        assert torch.equal(value, buffers[1][name]), f"{name} differs across ranks"


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_nn_batchnorm2d_fails_in_the_same_set_up(low: torch.dtype) -> None:
    # The reason for converting: torch's kernel refuses 16-bit weights beside float32 running
    # statistics. If a torch release fixes it, this fails: update docs/works-with.md then.
    name = {torch.bfloat16: "BFloat16", torch.float16: "Half"}[low]
    for message in (r[f"plain-{low}"] for r in _results()):
        assert f"expected scalar type {name} but found Float" in message, message


def test_an_in_place_layer_first_in_a_unit_is_refused_as_nn_relu_inplace_is() -> None:
    # FSDP2 hands a unit its input as a view returned by its own autograd Function; autograd
    # refuses any in-place write to it. Put an operation before the layer inside the unit (as
    # in every conv block), or make the layer's unit start earlier. If FSDP lifts it, this fails.
    for syncbn_message, torch_message in (r["first-in-unit"] for r in _results()):
        assert "is a view and is being modified inplace" in torch_message, torch_message
        assert syncbn_message == torch_message


def _bf16_params(layer: nn.Module) -> nn.Module:
    """What FSDP2's bf16 policy gives a layer in one process: bf16 parameters, float32 buffers."""
    for name, p in list(layer.named_parameters(recurse=False)):
        setattr(layer, name, nn.Parameter(p.detach().bfloat16()))
    return layer


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_group_path_with_bf16_parameters_trains_and_evaluates(family: str, compiled: bool) -> None:
    # Not distributed: the no-group path (torch's kernel; given these parameters alone it raises).
    gen = torch.Generator().manual_seed(3)
    layer = _bf16_params(_layer(family))
    with torch.no_grad():
        layer.weight.copy_(torch.rand(C, generator=gen) + 0.5)
        layer.bias.copy_(torch.randn(C, generator=gen))
    w64, b64 = layer.weight.detach().double(), layer.bias.detach().double()
    # The input made inside the compiled graph, as in a model (a graph input:
    # tests/test_compile_graph_input.py).
    unit = nn.Sequential(_Copy(), layer)
    run = torch.compile(unit, backend="aot_eager", fullgraph=True) if compiled else unit
    x = (torch.randn(6, C, H, W, generator=gen) * 1.5 + 3.0).bfloat16()
    g = torch.randn(6, C, H, W, generator=gen).bfloat16()
    x_in = x.clone().requires_grad_()
    y = run(x_in)
    y.backward(g)
    rm64, rv64 = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y_ref, dx_ref, dw_ref, db_ref, rm64, rv64 = _reference(
        family, x.double(), g.double(), w64, b64, rm64, rv64
    )
    assert y.dtype == torch.bfloat16 and layer.running_mean.dtype == torch.float32
    for got, ref in ((y, y_ref), (x_in.grad, dx_ref), (layer.weight.grad, dw_ref), (layer.bias.grad, db_ref)):
        assert _units(got, ref, torch.bfloat16) <= K
    assert _units(layer.running_mean, rm64, torch.float32) <= K_STATS
    assert _units(layer.running_var, rv64, torch.float32) <= K_STATS
    layer.eval()
    assert _units(run(x), _eval_reference(family, x.double(), layer, w64, b64), torch.bfloat16) <= K
    torch._dynamo.reset()  # (its compiled frames count towards later tests' recompile limit)
