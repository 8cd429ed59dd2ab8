"""The synchronised forward of one replica, and the joint backward of all of them.

:func:`replica_batch_norm` is a replica's training forward: the moments of its
chunk, summed over the replicas in replica order by a
:class:`~syncbn._threads.ThreadSumGroup`, then its own normalisation. The
replicas' outputs then become the outputs of ONE autograd node,
:class:`_JointBatchNorm`, whose backward receives every replica's output
gradient at once: backward never waits for another thread (see
:mod:`syncbn.parallel`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import _math
from .._function import finish_input_grad, gradient_dtype, local_grad_sums, synchronized_forward
from .._function import one_value_error as engine_one_value_error
from .._threads import Rendezvous, ThreadSumGroup, ordered_sum

__all__ = ["replica_batch_norm"]


class Replication(Protocol):
    """What a replica's forward needs from its replication."""

    def rendezvous(self) -> Rendezvous: ...

    def describe(self) -> str: ...

    def publish(self, replica: nn.Module) -> None: ...


class _Record(NamedTuple):
    """One replica's contribution to the joint autograd node."""

    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    y: Tensor
    effective_weight: Tensor | None  # the weight the forward used (the family's, else ``weight``)
    family: Any  # the family object (syncbn.families) and its (r, d), or None
    correction: tuple[Tensor, Tensor] | None
    mean: Tensor
    var: Tensor
    total: float | Tensor
    n: int  # values per channel in this replica
    eps: float
    needs_grad: bool


def replica_batch_norm(
    layer: _BatchNorm, x: Tensor, momentum: float, replication: Replication, rank: int
) -> Tensor:
    """Training-mode forward of replica ``rank`` of ``layer``, synchronised with its siblings.

    Args:
        layer: the replica (a syncbn layer).
        x: this replica's chunk of the batch.
        momentum: the running-statistics factor for this call.
        replication: the replicas' shared replication.
        rank: this replica's index in it.

    Returns:
        This replica's output, one of the outputs of the joint autograd node.
    """
    rendezvous = replication.rendezvous()
    tracking = bool(layer.track_running_stats)
    running_mean = layer.running_mean if tracking else None
    running_var = layer.running_var if tracking else None
    weight, bias, eps = layer.weight, layer.bias, float(layer.eps)
    batches = layer.num_batches_tracked if tracking else None
    family_call = getattr(layer, "_family_call", None)
    family = None if family_call is None else family_call()

    if rendezvous.size == 1 and family is None:
        single = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
        if batches is not None:
            batches.add_(1)
        replication.publish(layer)
        return single

    def one_value_error() -> ValueError:
        members = f"replicas of {replication.describe()}"
        return engine_one_value_error(x, rendezvous.size, members, who="this replica's")

    with torch.no_grad():
        result = synchronized_forward(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            eps,
            momentum,
            ThreadSumGroup(rendezvous, rank).all_reduce_sum,
            one_value_error,
            family,
        )
        if batches is not None:
            batches.add_(1)
    if rank == 0:
        replication.publish(layer)

    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    record = _Record(
        x=x,
        weight=weight,
        bias=bias,
        y=result.out,
        effective_weight=weight if result.correction is None else result.weight,
        family=result.family,
        correction=result.correction,
        mean=result.mean,
        var=result.var,
        total=result.total,
        n=result.local_count,
        eps=eps,
        needs_grad=needs_grad,
    )
    outputs = rendezvous.exchange(rank, record, what="join outputs for autograd", combine=_join)
    out: Tensor = outputs[rank]
    return out


def _join(records: list[_Record]) -> list[Tensor]:
    """Make the replicas' outputs the outputs of ONE autograd node (runs once, in one thread)."""
    if not any(r.needs_grad for r in records):
        return [r.y for r in records]
    tensors = [r.x for r in records] + [r.weight for r in records] + [r.bias for r in records]
    with torch.enable_grad():
        outputs = _JointBatchNorm.apply(records, *tensors)
    return list(outputs)


class _JointBatchNorm(torch.autograd.Function):
    """Identity on the precomputed outputs in forward; joint backward of all replicas.

    Inputs: every replica's ``x``, then every ``weight``, then every ``bias``.
    Outputs: every replica's normalised output.
    """

    @staticmethod
    def forward(ctx: Any, records: list[_Record], *tensors: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        size = len(records)
        ctx.size = size
        ctx.meta = [(r.mean, r.var, r.total, r.n) for r in records]
        ctx.families = [(r.family, r.correction) for r in records]
        ctx.eps = records[0].eps
        ctx.param_dtype = [gradient_dtype(r.weight, r.bias, r.mean) for r in records]
        xs = tensors[:size]
        ctx.save_for_backward(*xs, *(r.effective_weight for r in records))  # the xs and the forward's weights
        return tuple(r.y for r in records)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        size = ctx.size
        saved = ctx.saved_tensors
        xs, weights = saved[:size], saved[size:]
        eps = ctx.eps
        needs = ctx.needs_input_grad[1:]
        sums = [
            local_grad_sums(grads[k], xs[k], weights[k], ctx.meta[k][0], ctx.meta[k][1], eps, ctx.meta[k][3])
            for k in range(size)
        ]
        reduced = ordered_sum([_math.pack_grad_sums(*s) for s in sums])  # replica order: reproducible
        grad_inputs: list[Tensor | None] = []
        for k in range(size):
            mean, var, total, count = ctx.meta[k]
            grad_inputs.append(
                finish_input_grad(grads[k], xs[k], weights[k], mean, var, eps, total, count, reduced)
                if needs[k]
                else None
            )
        for k, (family, correction) in enumerate(ctx.families):
            if correction is not None:
                sum_dy_xhat, sum_dy = family.parameter_grads(sums[k][0], sums[k][1], *correction)
                sums[k] = (sum_dy, sum_dy_xhat)
        grad_weights = [sums[k][1].to(ctx.param_dtype[k]) if needs[size + k] else None for k in range(size)]
        grad_biases = [
            sums[k][0].to(ctx.param_dtype[k]) if needs[2 * size + k] else None for k in range(size)
        ]
        return (None, *grad_inputs, *grad_weights, *grad_biases)
