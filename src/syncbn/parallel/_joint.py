"""The synchronised forward of one replica, and the joint backward of all of them.

The replicas' outputs become the outputs of ONE autograd node, :class:`_JointBatchNorm`, so
backward never waits for another thread. See docs/internals/transports.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _accumulating, _cmbn
from .._threads import Rendezvous, ReplicaSyncError, ThreadSumGroup, ordered_sum
from ..engine import _math, _rules
from ..engine._double_backward import joint_input_grads, replica_total
from ..engine._function import Params, inplace_abn_apply, synchronized_forward
from ..engine._math import finish_input_grad, local_grad_sums
from ..engine._rules import gradient_dtype
from ..engine._rules import one_value_error as engine_one_value_error
from ..families.inplace_abn import DOUBLE_BACKWARD, check_writable


class Replication(Protocol):
    """What a replica's forward needs from its replication."""

    master: Any  # the layer the user holds
    recomputing: bool  # made by a checkpoint's recomputation (in a backward): no running update

    def rendezvous(self) -> Rendezvous: ...

    def describe(self) -> str: ...

    def publish(self, replica: nn.Module) -> None: ...


class _Record(NamedTuple):
    """One replica's contribution to the joint autograd node."""

    x: Tensor  # what backward reads: the input (the in-place family: the output written over it)
    weight: Tensor | None
    bias: Tensor | None
    y: Tensor
    effective_weight: Tensor | None  # the weight the forward used (the family's, else ``weight``)
    family: Any  # the family object (syncbn.families), or None
    correction: tuple[Tensor, Tensor] | None  # the family's (r, d), or None
    stats: Any  # the backward's statistics (syncbn.engine._math.Stats, or the family's)
    needs_grad: bool
    pooled: bool  # normalised with statistics pooled by a hook (CmBN): see joint_input_grads


def replica_batch_norm(
    layer: Any, x: Tensor, momentum: float, replication: Replication, rank: int, family: Any = None
) -> Tensor:
    """Training-mode forward of replica ``rank`` of ``layer``, synchronised with its siblings.

    ``momentum`` is this call's running-statistics factor; ``family`` ``None`` means the layer's
    own (``_family_call``) or batch norm. The in-place family overwrites ``x`` with the output.
    A recomputation (a reentrant checkpoint around the model) leaves the running statistics and
    ``num_batches_tracked`` as the forward left them, and renorm reads the forward's statistics.
    """
    rendezvous = replication.rendezvous()
    tracking = bool(layer.track_running_stats) and not replication.recomputing
    running_mean, running_var, batches = (
        (layer.running_mean, layer.running_var, layer.num_batches_tracked) if tracking else (None, None, None)
    )
    if replication.recomputing and layer.track_running_stats:  # updated with factor 0 (the same saves)
        running_mean, running_var, momentum = layer.running_mean, layer.running_var, 0.0
    weight, bias, eps = layer.weight, layer.bias, float(layer.eps)
    if family is None:
        family_call = getattr(layer, "_family_call", None)
        family = None if family_call is None else family_call(replication.recomputing)
        if family is not None and replication.recomputing:  # (the forward's statistics, on x's device)
            family = family.snapshot(lambda t: t.to(x.device))
        elif family is not None and rank == 0:  # the user's layer keeps what a recomputation reads
            replication.master._family_call(False, True)
    in_place = family is not None and family.in_place
    statistics = _cmbn.statistics(layer, replication.recomputing)  # pooled: updated at the block's end

    # one replica: torch's kernel, unless syncbn.accumulation listens (the engine reports moments)
    listened = running_mean is not None and _accumulating.listening(running_mean) is not None
    if rendezvous.size == 1 and (family is None or in_place) and not listened:
        if in_place:
            args = (True, momentum, eps, family.activation, family.param, None)
            single = inplace_abn_apply(x, weight, bias, running_mean, running_var, *args)
        else:
            single = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
        if batches is not None:
            batches.add_(1)
        replication.publish(layer)
        return single

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

    if in_place:
        check_writable(x, "in-place activated batch norm")
    group = ThreadSumGroup(rendezvous, rank)
    if statistics is not _cmbn.THIS_CALL:
        running_mean = running_var = None
    params = Params(running_mean, running_var, eps, momentum, group, layer, family, statistics)
    with torch.no_grad():
        result = synchronized_forward(x, weight, bias, params, group.all_reduce_sum, one_value_error)
        if batches is not None:
            batches.add_(1)
    if rank == 0:
        replication.publish(layer)

    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    y = result.out
    if in_place and not needs_grad:  # written over x, which may still carry the graph before it
        y = y.detach()  # a constant, as the layer alone under no_grad gives
    pooled = statistics is not _cmbn.THIS_CALL
    record = _Record(
        x, weight, bias, y, result.weight, family, result.correction, result.stats, needs_grad, pooled
    )
    return rendezvous.exchange(rank, record, what="join outputs for autograd", combine=_join)[rank]


def _join(records: list[_Record]) -> list[Tensor]:
    """Make the replicas' outputs the outputs of ONE autograd node (runs once, in one thread).

    A replica that ran without grad (``torch.no_grad()``, or nothing requiring grad) keeps its plain
    output, a constant as ``nn.BatchNorm``'s would be: its rows count in the statistics, its upstream
    gradient is zero.
    """
    active = [k for k, r in enumerate(records) if r.needs_grad]
    joined = [r.y for r in records]
    if not active:
        return joined
    tensors = [records[k].x for k in active] + [records[k].weight for k in active]
    tensors += [records[k].bias for k in active]
    with torch.enable_grad():
        outputs = _JointBatchNorm.apply(records, active, *tensors)
    for k, out in zip(active, outputs):
        joined[k] = out
    return joined


class _JointBatchNorm(torch.autograd.Function):
    """Identity on the precomputed outputs in forward; joint backward of all replicas.

    Inputs: the replicas ``active`` (those that need grad): every such replica's ``x``, then every
    ``weight``, then every ``bias``. Outputs: their outputs (the in-place family: their ``x``,
    marked dirty). The other replicas' upstream gradient is zero.
    """

    @staticmethod
    def forward(
        ctx: Any, records: list[_Record], active: list[int], *tensors: Tensor | None
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        size = len(active)
        family = records[0].family
        ctx.size, ctx.family, ctx.active = size, family, active
        ctx.pooled = records[0].pooled
        ctx.stats = [r.stats for r in records]  # every replica's (the double backward's statistics)
        ctx.corrections = [records[k].correction for k in active]
        ctx.param_dtype = [gradient_dtype(r.weight, r.bias, r.x) for r in (records[k] for k in active)]
        ys = [records[k].y for k in active]
        if family is not None and family.in_place:
            ctx.mark_dirty(*ys)
        # the xs, the forward's weights, the biases (a family's correction: the layers' weights too,
        # which the double backward differentiates through); then the constant xs of the replicas
        # without grad (their rows count in the double backward's statistics)
        own = tensors[size : 2 * size] if any(c is not None for c in ctx.corrections) else ()
        ctx.n_own = len(own)
        idle = [r.x.detach() for k, r in enumerate(records) if k not in active]
        ctx.save_for_backward(
            *tensors[:size],
            *(records[k].effective_weight for k in active),
            *tensors[2 * size : 3 * size],
            *own,
            *idle,
        )
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        size, family, active = ctx.size, ctx.family, ctx.active
        stats = [ctx.stats[k] for k in active]
        in_place = family is not None and family.in_place
        if in_place and torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        saved = ctx.saved_tensors
        xs, weights, biases = saved[:size], saved[size : 2 * size], saved[2 * size : 3 * size]
        needs = ctx.needs_input_grad[2:]
        extras = [(w,) for w in weights] if in_place else ctx.corrections  # family.parameter_grads' args
        grad_inputs: list[Tensor | None] = [None] * size
        if not in_place and torch.is_grad_enabled() and stats[0].total:  # create_graph=True
            own = saved[3 * size : 3 * size + ctx.n_own]
            if own:  # the effective scale from the differentiable weight
                weights = tuple(family.scale(w, c[0]) for w, c in zip(own, ctx.corrections))
            joint = _joint_input_grads(
                ctx, list(grads), list(xs), list(weights), saved[3 * size + ctx.n_own :]
            )
            grad_inputs = [j[0] if needs[k] else None for k, j in enumerate(joint)]
            sums: list[Any] = [(j[2], j[1]) for j in joint]
        else:
            if in_place:  # the family's local reduction, recovering xhat from each output
                parts = [
                    family.grad_sums(xs[k], grads[k], weights[k], biases[k], stats[k]) for k in range(size)
                ]
            else:
                parts = [(None, *local_grad_sums(grads[k], xs[k], weights[k], stats[k])) for k in range(size)]
            sums = [p[1:] for p in parts]
            reduced = ordered_sum([_math.pack_grad_sums(*s) for s in sums])  # replica order: reproducible
            for k in range(size):
                if needs[k] and in_place:
                    grad_inputs[k] = family.input_grad(
                        xs[k], weights[k], biases[k], stats[k], parts[k][0], reduced
                    )
                elif needs[k]:
                    grad_inputs[k] = finish_input_grad(grads[k], xs[k], weights[k], stats[k], reduced)
        for k, extra in enumerate(extras):  # (sum dy, sum dy * xhat) -> the family's (dbias, dweight)
            if extra is not None:
                sums[k] = family.parameter_grads(*sums[k], *extra)[::-1]
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
    all_xs = [xs[active.index(k)] if k in active else next(rest) for k in range(len(ctx.stats))]
    all_grads = [grads[active.index(k)] if k in active else torch.zeros_like(x) for k, x in enumerate(all_xs)]
    all_weights = [weights[active.index(k)] if k in active else None for k in range(len(ctx.stats))]
    joint = joint_input_grads(all_grads, all_xs, all_weights, ctx.stats, replica_total, ctx.pooled)
    return [joint[k] for k in active]
