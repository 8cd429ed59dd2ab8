"""One step of two modules on the same input and upstream gradient, compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms import Join


def assert_same_step(ours: nn.Module, ref: nn.Module, x: Tensor) -> None:
    """Run ``ours`` and ``ref`` forward on copies of ``x`` and backward with one random upstream gradient.

    Asserts that the outputs and the input gradients are ``torch.equal``.

    Args:
        ours: the module under test.
        ref: the reference module.
        x: the input (copied for each module).
    """
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)


def rank_steps_errors(
    ours: nn.Module,
    ref: nn.Module,
    rank: int,
    sizes: list[int],
    shape: tuple[int, ...],
    gen: torch.Generator,
    shift: float,
    steps: int = 2,
) -> dict[str, float]:
    """``steps`` forward/backward steps of ``ours`` on this rank's rows and ``ref`` on all of them.

    Inputs of ``shape`` per sample (float64, scaled by 2 and shifted by ``shift``), a random
    upstream gradient; then the parameter gradients summed over the ranks (what DDP does) against
    the reference's. Returns the largest difference per quantity.
    """
    start = sum(sizes[:rank])
    mine_rows = slice(start, start + sizes[rank])
    errors: dict[str, float] = {}
    for step in range(steps):
        x = torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64) * 2 + shift
        mine, full = x[mine_rows].clone().requires_grad_(), x.clone().requires_grad_()
        y_ref = ref(full)
        g = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
        y_ref.backward(g)
        y = ours(mine)
        y.backward(g[mine_rows])
        errors[f"out{step}"] = (y - y_ref[mine_rows]).abs().max().item()
        errors[f"grad{step}"] = (mine.grad - full.grad[mine_rows]).abs().max().item()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)  # DDP's sum over ranks: the big batch's gradient
        errors[f"param {name}"] = (grad - q.grad).abs().max().item()
    return errors


def join_reference_step(
    ref: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Callable[[int, int], tuple[Tensor, Tensor]],
    step: int,
    batches: Sequence[int],
    rank: int,
) -> Tensor:
    """One step of the global-batch reference of a Join run; this rank's rows of its output.

    ``ref`` runs on the concatenation of ``batch(step, r)`` inputs of the ranks ``r`` still
    training (``step < batches[r]``), backward with their upstream gradients divided by the world
    size (DDP divides by the initial world size; a joined rank contributes zero gradients), then
    ``opt`` steps. ``batches`` holds one count per rank (its length is the world size); a rank
    that has joined gets an empty slice.
    """
    active = [r for r in range(len(batches)) if step < batches[r]]
    pairs = [batch(step, r) for r in active]
    y = ref(torch.cat([x for x, _ in pairs]))
    (y * torch.cat([g for _, g in pairs])).sum().div(len(batches)).backward()
    opt.step()
    opt.zero_grad()
    if rank not in active:
        return y.detach()[:0]
    lo = sum(x.shape[0] for x, _ in pairs[: active.index(rank)])
    return y.detach()[lo : lo + pairs[active.index(rank)][0].shape[0]]


def join_run(
    ddp: nn.Module,
    joinable: Any,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    batch: Callable[[int, int], tuple[Tensor, Tensor]],
    batches: Sequence[int],
    rank: int,
    error: Callable[[Tensor, Tensor], float],
) -> list[float]:
    """Train ``ddp`` under ``Join([joinable, ddp])`` for this rank's ``batches[rank]`` steps.

    Beside each step, the reference's step (:func:`join_reference_step`); after them, the
    reference's steps the other ranks still train. Returns ``error(y, y_ref)`` per step.
    """
    errors: list[float] = []
    with Join([joinable, ddp]):
        for step in range(batches[rank]):
            y_ref = join_reference_step(ref, ref_opt, batch, step, batches, rank)
            x, g = batch(step, rank)
            y = ddp(x)
            (y * g).sum().backward()
            opt.step()
            opt.zero_grad()
            errors.append(error(y, y_ref))
    for step in range(batches[rank], max(batches)):  # the steps the others still train
        join_reference_step(ref, ref_opt, batch, step, batches, rank)
    return errors
