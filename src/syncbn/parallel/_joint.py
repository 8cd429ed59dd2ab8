"""The synchronised forward of one replica, and the joint backward of all of them, ONE autograd node
(backward never waits for another thread). See docs/internals/transports.md."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .. import _accumulating
from .._threads import Rendezvous, ReplicaSyncError, ThreadSumGroup, ordered_sum
from ..engine import _math, _rules
from ..engine._double_backward import joint_input_grads, replica_total
from ..engine._function import Params, apply, synchronized_forward
from ..engine._rules import gradient_dtype
from ..engine._rules import one_value_error as engine_one_value_error

# What a replica hands the joint node: (x, weight, bias, y, record, family, needs_grad, pooled by CmBN).
_Item = tuple[Tensor, Any, Any, Tensor, Any, Any, bool, bool]


class Replication(Protocol):
    """What a replica's forward needs of its replication (:class:`._replication._Replication`)."""

    def rendezvous(self) -> Rendezvous: ...

    def publish(self, replica: Any) -> None: ...

    def describe(self) -> str: ...


def replica_batch_norm(
    layer: Any, x: Tensor, call: Any, replication: Replication, rank: int, family: Any
) -> Tensor:
    """Training-mode forward of replica ``rank`` of ``layer``, synchronised with its siblings (``call``:
    the layer's ``TrainingCall``; the in-place family overwrites ``x``)."""
    rendezvous = replication.rendezvous()
    running_mean, momentum = call.running_mean, call.momentum
    weight, bias, eps = layer.weight, layer.bias, float(layer.eps)
    family.check_input(x)

    # one replica: the family's own one-process call, unless syncbn.accumulation listens (the
    # engine reports moments) or the family synchronises over the one member
    listened = running_mean is not None and _accumulating.listening(running_mean) is not None
    if rendezvous.size == 1 and not listened:
        mean, var = call.updated()
        engine = lambda: apply(x, weight, bias, Params(mean, var, eps, momentum, None, None, family))  # noqa: E731
        single = family.alone(x, weight, bias, mean, var, momentum, eps, engine)
        if single is not None:
            replication.publish(layer)
            return call.counted(single)  # type: ignore[no-any-return]

    if x.is_cpu and _rules.in_backward():  # a checkpoint's recomputation, in the one backward thread
        raise ReplicaSyncError(
            f"syncbn: {replication.describe()}: activation checkpointing recomputes replica {rank}'s "
            "synchronised layer during backward, where the replicas on CPU run their backward in one "
            "thread and cannot meet to synchronise it again: checkpoint around the whole "
            "DataParallel model, or leave the synchronised layers out of the checkpointed regions"
        )

    def one_value_error() -> ValueError:
        members = f"replicas of {replication.describe()}"
        return engine_one_value_error(x, rendezvous.size, members, who="this replica's")

    group = ThreadSumGroup(rendezvous, rank)
    params = call.params(eps, group, layer, family)
    with torch.no_grad():
        record = call.counted(
            synchronized_forward(x, weight, bias, params, group.all_reduce_sum, one_value_error)
        )
    if rank == 0:
        replication.publish(layer)

    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    y = record.out
    if family.saves_output and not needs_grad:  # written over x, which may still carry the graph before it
        y = y.detach()  # a constant, as the layer alone under no_grad gives
    item: _Item = (x, weight, bias, y, record, family, needs_grad, call.pooled)
    return rendezvous.exchange(rank, item, what="join outputs for autograd", combine=_join)[rank]


def _join(items: list[_Item]) -> list[Tensor]:
    """Make the replicas' outputs the outputs of ONE autograd node (once, in one thread); a replica
    without grad keeps its plain output, a constant (its rows count, its gradient is zero)."""
    active = [k for k, item in enumerate(items) if item[6]]
    joined = [item[3] for item in items]
    if not active:
        return joined
    tensors = [items[k][0] for k in active] + [items[k][1] for k in active] + [items[k][2] for k in active]
    with torch.enable_grad():
        outputs = _JointBatchNorm.apply(items, active, *tensors)
    for k, out in zip(active, outputs):
        joined[k] = out
    return joined


class _JointBatchNorm(torch.autograd.Function):
    """Identity on the precomputed outputs in forward; joint backward of all replicas. Inputs: every
    ``active`` replica's ``x`` (those that need grad), then ``weight``, then ``bias``."""

    @staticmethod
    def forward(
        ctx: Any, items: list[_Item], active: list[int], *tensors: Tensor | None
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        size, family = len(active), items[0][5]
        ctx.size, ctx.family, ctx.active, ctx.pooled = size, family, active, items[0][7]
        # every replica's record, without its output (a reference cycle): the double backward's statistics
        ctx.records = [item[4]._replace(out=None) for item in items]
        ctx.param_dtype = [gradient_dtype(w, b, x) for x, w, b, *_ in (items[k] for k in active)]
        ys = [items[k][3] for k in active]
        if family.saves_output:
            ctx.mark_dirty(*ys)
        # the xs, the forward's weights, the biases (with a correction: the layers' weights too, for the
        # double backward); then the constant xs of the replicas without grad (their rows count)
        own = tensors[size : 2 * size] if any(ctx.records[k].correction is not None for k in active) else ()
        ctx.n_own = len(own)
        idle = [item[0].detach() for k, item in enumerate(items) if k not in active]
        weights = (ctx.records[k].weight for k in active)
        ctx.save_for_backward(*tensors[:size], *weights, *tensors[2 * size : 3 * size], *own, *idle)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        size, family, active = ctx.size, ctx.family, ctx.active
        records = [ctx.records[k] for k in active]
        if torch.is_grad_enabled() and not family.second_order:
            raise RuntimeError(family.double_backward_error)
        saved = ctx.saved_tensors
        xs, weights, biases = saved[:size], saved[size : 2 * size], saved[2 * size : 3 * size]
        needs = ctx.needs_input_grad[2:]
        grad_inputs: list[Tensor | None] = [None] * size
        if torch.is_grad_enabled() and records[0].total:  # create_graph=True
            own = saved[3 * size : 3 * size + ctx.n_own]
            if own:  # the effective scale from the differentiable weight
                weights = tuple(family.differentiable_weight(w, r.correction) for w, r in zip(own, records))
            joint = _joint_input_grads(
                ctx, list(grads), list(xs), list(weights), saved[3 * size + ctx.n_own :]
            )
            grad_inputs = [j[0] if needs[k] else None for k, j in enumerate(joint)]
            sums: list[Any] = [(j[2], j[1]) for j in joint]
        else:  # the family's local reduction, ONE sum in replica order (reproducible), its input gradient
            args = [(xs[k], grads[k], weights[k], biases[k], records[k]) for k in range(size)]
            parts = [family.grad_sums(*a, needs[k]) for k, a in enumerate(args)]
            sums = [p[1:] for p in parts]
            reduced = ordered_sum([_math.pack_grad_sums(*s) for s in sums])
            for k in range(size):
                if needs[k]:
                    grad_inputs[k] = family.input_grad(*args[k], parts[k][0], reduced)
        for k in range(size):  # (sum dy, sum dy * xhat) -> the family's (dbias, dweight)
            sums[k] = family.parameter_grads(*sums[k], weights[k], records[k].correction)[::-1]
        grad_weights = [sums[k][1].to(ctx.param_dtype[k]) if needs[size + k] else None for k in range(size)]
        grad_biases = [
            sums[k][0].to(ctx.param_dtype[k]) if needs[2 * size + k] else None for k in range(size)
        ]
        return (None, None, *grad_inputs, *grad_weights, *grad_biases)


def _joint_input_grads(
    ctx: Any, grads: list[Tensor], xs: list[Tensor], weights: list[Tensor | None], idle: tuple[Tensor, ...]
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`joint_input_grads` of the active replicas, the others (constants, zero gradient) included."""
    active, rest = ctx.active, iter(idle)
    all_xs = [xs[active.index(k)] if k in active else next(rest) for k in range(len(ctx.records))]
    all_grads = [grads[active.index(k)] if k in active else torch.zeros_like(x) for k, x in enumerate(all_xs)]
    all_weights = [weights[active.index(k)] if k in active else None for k in range(len(ctx.records))]
    joint = joint_input_grads(all_grads, all_xs, all_weights, ctx.records, replica_total, ctx.pooled)
    return [joint[k] for k in active]
