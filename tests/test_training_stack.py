"""syncbn in the modern training stack, on real gloo ranks against nn.BatchNorm on the global batch.

Double backward (gradient penalty), torch.func.grad over functional_call (and
vmap's clear error), activation checkpointing (reentrant and not: gradients
exact, running statistics updated once), DDP ``no_sync`` and plain gradient
accumulation, autocast bf16, FSDP2 ``fully_shard``, and DDP ``Join`` with
uneven numbers of batches. Every case runs on both transports (shared memory
and the process group's own) in one launch per transport; float64 unless the
case is about a lower precision. ``torch.compile`` is in
``test_compile.py``.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms import Join
from torch.utils.checkpoint import checkpoint

import syncbn
from _helpers.compare import join_run
from _helpers.dist_harness import launch, launch_once

SIZES = (3, 5)  # per-rank batch sizes of the 2-rank cases (uneven on purpose)


def _global(seed: int, shape: tuple[int, ...], scale: float = 2.0, shift: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g) * scale + shift


def _shard(t: Tensor, rank: int, sizes: tuple[int, ...] = SIZES) -> Tensor:
    lo = sum(sizes[:rank])
    return t[lo : lo + sizes[rank]]


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
    ).double()
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.BatchNorm1d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def _max_err(a: Any, b: Any) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _summed_grads(model: nn.Module) -> Tensor:
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    return flat


def _grads(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _state_err(ours: nn.Module, ref: nn.Module) -> float:
    return max(_max_err(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))


def _double_backward(rank: int) -> dict[str, float]:
    """Gradient penalty ||d loss / d x||^2 through syncbn on 2 ranks == nn.BatchNorm on the global batch."""
    n = sum(SIZES)
    X, G = _global(1, (n, 3)), _global(2, (n, 2), 1.0, 0.0)
    ref = _mlp()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))

    def total(model: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, float]:
        x = x.clone().requires_grad_()
        loss = (torch.tanh(model(x)) * g).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + 0.7 * (gx**2).sum()).backward()
        return x, float(gx.abs().max())

    ref_x, penalty_size = total(ref, X, G)
    ours_x, _ = total(ours, _shard(X, rank), _shard(G, rank))
    return {
        "param grads": _max_err(_summed_grads(ours), _grads(ref)),
        "input grad": _max_err(ours_x.grad, _shard(ref_x.grad, rank)),
        "state": _state_err(ours, ref),
        "penalty is not trivial": 0.0 if penalty_size > 1e-3 else 1.0,
    }


def _func_grad(rank: int) -> dict[str, float]:
    """torch.func.grad over functional_call, buffers passed in (they are updated in place)."""
    n = sum(SIZES)
    X, G = _global(3, (n, 3)), _global(4, (n, 2), 1.0, 0.0)
    ref = _mlp()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    params = {k: v.detach() for k, v in ours.named_parameters()}
    buffers = dict(ours.named_buffers())
    x, g = _shard(X, rank), _shard(G, rank)

    def loss(p: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
        return (torch.func.functional_call(ours, (p, b), (x,)) * g).sum()

    grads = torch.func.grad(loss)(params, buffers)
    flat = torch.cat([grads[k].flatten() for k in params])
    dist.all_reduce(flat)
    (ref(X) * G).sum().backward()
    return {"param grads": _max_err(flat, _grads(ref)), "state": _state_err(ours, ref)}


def _vmap_refuses(rank: int) -> dict[str, float]:
    ours = syncbn.convert_sync_batchnorm(_mlp())
    params, buffers = dict(ours.named_parameters()), dict(ours.named_buffers())
    x = _global(5, (4, 2, 3))
    try:
        torch.func.vmap(lambda xx: torch.func.functional_call(ours, (params, buffers), (xx,)))(x)
    except NotImplementedError as exc:
        return {"clear error": 0.0 if "vmap" in str(exc) and "not supported" in str(exc) else 1.0}
    return {"clear error": 1.0}


def _checkpointed(reentrant: bool) -> Callable[[int], dict[str, float]]:
    def case(rank: int) -> dict[str, float]:
        n = sum(SIZES)
        X, G = _global(6, (n, 3)), _global(7, (n, 2), 1.0, 0.0)
        ref = _mlp()
        ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
        body, head = ours[:5], ours[5:]
        for _ in range(2):  # running statistics: once per step, over two steps
            x = _shard(X, rank).clone().requires_grad_()
            y = head(checkpoint(body, x, use_reentrant=reentrant))
            (y * _shard(G, rank)).sum().backward()
            (ref(X) * G).sum().backward()
        tracked = ours[1].num_batches_tracked
        return {
            "param grads": _max_err(_summed_grads(ours), _grads(ref)),
            "state (running stats updated once per forward)": _state_err(ours, ref),
            "num_batches_tracked == 2": float(int(tracked) != 2),
        }

    return case


def _accumulation(ddp_no_sync: bool) -> Callable[[int], dict[str, float]]:
    """Two micro-batches per step; each is normalised over the global micro-batch."""

    def case(rank: int) -> dict[str, float]:
        n = sum(SIZES)
        micro = [(_global(10 + i, (n, 3)), _global(20 + i, (n, 2), 1.0, 0.0)) for i in range(2)]
        ref = _mlp()
        ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
        model: nn.Module = nn.parallel.DistributedDataParallel(ours) if ddp_no_sync else ours
        for i, (X, G) in enumerate(micro):
            x, g = _shard(X, rank), _shard(G, rank)
            if ddp_no_sync and i == 0:
                with model.no_sync():  # type: ignore[operator]
                    (model(x) * g).sum().backward()
            else:
                (model(x) * g).sum().backward()
            (ref(X) * G).sum().backward()
        # DDP averages the (accumulated) gradients over ranks; without DDP, sum them here.
        got = _grads(ours) * dist.get_world_size() if ddp_no_sync else _summed_grads(ours)
        return {"param grads": _max_err(got, _grads(ref)), "state": _state_err(ours, ref)}

    return case


def _autocast_bf16(rank: int) -> dict[str, float]:
    """autocast("cpu", bfloat16): the same output dtype as nn.BatchNorm, equal to bf16 rounding."""
    n = sum(SIZES)
    X, G = _global(30, (n, 3)).float(), _global(31, (n, 2), 1.0, 0.0).float()
    ref = _mlp().float()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    with torch.autocast("cpu", torch.bfloat16):
        y_ref = ref(X)
        y = ours(_shard(X, rank))
    (y.float() * _shard(G, rank)).sum().backward()
    (y_ref.float() * G).sum().backward()
    scale = float(y_ref.float().abs().max())
    return {
        "same dtype": float(y.dtype != y_ref.dtype),
        "output (relative to bf16 eps)": _max_err(y, _shard(y_ref, rank)) / scale / 2**-8,
        "param grads (relative to bf16 eps)": _max_err(_summed_grads(ours), _grads(ref))
        / float(_grads(ref).abs().max())
        / 2**-8,
        "state (relative to bf16 eps)": _state_err(ours, ref) / 2**-8,
    }


def _fsdp2(rank: int) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    n = sum(SIZES)
    X, G = _global(40, (n, 3)), _global(41, (n, 2), 1.0, 0.0)
    ref = _mlp()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    fully_shard(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        (ours(_shard(X, rank)) * _shard(G, rank)).sum().backward()
        (ref(X) * G).sum().div(dist.get_world_size()).backward()  # FSDP averages over ranks
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    params = max(_max_err(p.full_tensor(), q) for p, q in zip(ours.parameters(), ref.parameters()))
    buffers = max(_max_err(a, b) for a, b in zip(ours.buffers(), ref.buffers()))
    return {"params after 2 steps": params, "buffers": buffers}


CASES: dict[str, Callable[[int], dict[str, float]]] = {
    "double backward": _double_backward,
    "torch.func.grad": _func_grad,
    "torch.func.vmap refuses": _vmap_refuses,
    "checkpoint reentrant": _checkpointed(True),
    "checkpoint non-reentrant": _checkpointed(False),
    "accumulation": _accumulation(False),
    "DDP no_sync accumulation": _accumulation(True),
    "autocast bf16": _autocast_bf16,
    "FSDP2 fully_shard": _fsdp2,
}
TOLERANCE = {"autocast bf16": 4.0}  # in units of bf16 eps; float64 cases: 1e-12


def _run_cases(rank: int, world_size: int, shared_memory: bool) -> dict[str, Any]:
    syncbn.set_shared_memory(shared_memory)
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            out[name] = case(rank)
        except Exception as exc:  # noqa: BLE001 - reported per case
            out[name] = f"{type(exc).__name__}: {exc}"
    out["transport"] = syncbn.groups.resolve(None).uses_shared_memory  # type: ignore[union-attr]
    return out


def _results(shared_memory: bool) -> list[dict[str, Any]]:
    return launch_once(_run_cases, 2, shared_memory, timeout=240)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("name", list(CASES))
def test_training_stack_case(name: str, shared_memory: bool) -> None:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    if name == "FSDP2 fully_shard" and not hasattr(fsdp, "fully_shard"):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)")
    tol = TOLERANCE.get(name, 1e-12)
    for rank, result in enumerate(_results(shared_memory)):
        assert result["transport"] is shared_memory
        errors = result[name]
        assert isinstance(errors, dict), f"rank {rank}: {errors}"
        for key, value in errors.items():
            assert value <= tol, f"rank {rank} {name}: {key}: {value:.3g} > {tol:.3g}"


# Join: ranks with 3, 5 and 4 batches of different sizes; DDP and syncbn joinable.
BATCHES = (3, 5, 4)


def _join_batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    n = 2 + (rank + step) % 3
    return _global(100 * step + rank, (n, 3)), _global(100 * step + rank + 50, (n, 2), 1.0, 0.0)


def _join(rank: int, world_size: int, shared_memory: bool) -> dict[str, Any]:
    syncbn.set_shared_memory(shared_memory)
    ref = _mlp()
    model = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    ddp = nn.parallel.DistributedDataParallel(model)
    joinable = syncbn.JoinableSyncBatchNorm(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def error(y: Tensor, y_ref: Tensor) -> float:
        return max(_max_err(y, y_ref), _state_err(model, ref))

    errors = join_run(ddp, joinable, opt, ref, ref_opt, _join_batch, BATCHES, rank, error)
    return {"steps": errors, "final": _state_err(model, ref), "shadowed": joinable.shadowed}


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
def test_join_uneven_batches_equal_global_batchnorm(shared_memory: bool) -> None:
    results = launch(_join, 3, shared_memory, timeout=180)
    for rank, result in enumerate(results):
        assert len(result["steps"]) == BATCHES[rank]
        assert max(result["steps"]) <= 1e-12, f"rank {rank}: {result['steps']}"
        assert result["final"] <= 1e-12, f"rank {rank}: final state {result['final']}"
        # 4 collectives per step (2 layers, forward and backward) for each step it sat out.
        assert result["shadowed"] == 4 * (max(BATCHES) - BATCHES[rank]), f"rank {rank}"


def _join_wrong_order(rank: int, world_size: int) -> str:
    ddp = nn.parallel.DistributedDataParallel(syncbn.convert_sync_batchnorm(_mlp()))
    joinable = syncbn.JoinableSyncBatchNorm(ddp)
    try:
        Join([ddp, joinable])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_join_needs_the_joinable_first() -> None:
    for text in launch(_join_wrong_order, 2, timeout=60):
        assert "first in the Join list" in text


# Single process (no process group): what nn.BatchNorm gives, checkpointing done better.
def test_single_process_checkpoint_updates_running_stats_once() -> None:
    ref = _mlp()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    X = _global(50, (6, 3))
    for reentrant in (True, False):
        x = X.clone().requires_grad_()
        checkpoint(ours, x, use_reentrant=reentrant).sum().backward()
        ref(X).sum().backward()
    assert _state_err(ours, ref) <= 1e-15
    assert int(ours[1].num_batches_tracked) == 2


def test_single_process_func_grad_and_vmap_in_eval() -> None:
    ref = _mlp()
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(ref))
    X = _global(51, (6, 3))
    params = {k: v.detach() for k, v in ours.named_parameters()}

    def loss(p: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(ours, (p, b), (X,)).pow(2).sum()

    grads = torch.func.grad(loss)(params, dict(ours.named_buffers()))
    ref(X).pow(2).sum().backward()
    for (name, _), q in zip(ours.named_parameters(), ref.parameters()):
        assert _max_err(grads[name], q.grad) <= 1e-12, name
    ours.eval()
    ref.eval()
    per_sample = torch.func.vmap(lambda x: ours(x.unsqueeze(0)).squeeze(0))(X)
    assert _max_err(per_sample, ref(X)) <= 1e-12
