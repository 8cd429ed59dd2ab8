"""``nn.DataParallel`` replicas of the in-place activated layers (see :mod:`syncbn.parallel`).

The same protocol as batch norm's replicas (:mod:`syncbn.parallel._joint`):
each replica's thread computes its chunk's moments, a
:class:`~syncbn._threads.ThreadSumGroup` sums them over the replicas in replica
order, and the replica writes its normalised, activated chunk over its input.
The replicas' outputs (their inputs, overwritten) then become the outputs of
ONE autograd node, whose backward recovers every replica's ``xhat`` from its
output, sums the backward sums in replica order and returns each replica's
gradients: backward never waits for another thread.

A replica's input must be a tensor it may overwrite: the output of an earlier
operation of the replica (a convolution), not a chunk ``nn.DataParallel``
scattered (a view that autograd forbids writing over).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _abn, _math
from .._function import one_value_error as engine_one_value_error
from .._threads import ThreadSumGroup, ordered_sum
from ._joint import Replication

__all__ = ["replica_inplace_abn"]


class _Record(NamedTuple):
    y: Tensor
    weight: Tensor | None
    bias: Tensor | None
    stats: _abn.ABNStats
    eps: float
    activation: str
    param: float
    needs_grad: bool


def replica_inplace_abn(
    layer: Any,
    x: Tensor,
    momentum: float,
    replication: Replication,
    rank: int,
    activation: str,
    param: float,
) -> Tensor:
    """Training forward of replica ``rank`` of an in-place activated ``layer``, synchronised with the others.

    Args:
        layer: the replica.
        x: this replica's chunk (overwritten with the output).
        momentum: the running-statistics factor for this call.
        replication: the replicas' shared replication.
        rank: this replica's index in it.
        activation: the layer's activation name.
        param: its slope or alpha.

    Returns:
        ``x``, overwritten: one of the outputs of the joint autograd node.
    """
    rendezvous = replication.rendezvous()
    tracking = bool(layer.track_running_stats)
    running_mean = layer.running_mean if tracking else None
    running_var = layer.running_var if tracking else None
    weight, bias, eps = layer.weight, layer.bias, float(layer.eps)
    batches = layer.num_batches_tracked if tracking else None

    if rendezvous.size == 1:
        out = _abn.inplace_abn_apply(
            x, weight, bias, running_mean, running_var, True, momentum, eps, activation, param, None
        )
        if batches is not None:
            batches.add_(1)
        replication.publish(layer)
        return out

    def one_value_error() -> ValueError:
        members = f"replicas of {replication.describe()}"
        return engine_one_value_error(x, rendezvous.size, members, who="this replica's")

    _abn.check_writable(x, "in-place activated batch norm")
    with torch.no_grad():
        stats = _abn.abn_forward(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            True,
            momentum,
            eps,
            activation,
            param,
            ThreadSumGroup(rendezvous, rank).all_reduce_sum,
            one_value_error,
        )
        if batches is not None:
            batches.add_(1)
    if rank == 0:
        replication.publish(layer)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    record = _Record(x, weight, bias, stats, eps, activation, param, needs_grad)
    outputs = rendezvous.exchange(rank, record, what="join outputs for autograd", combine=_join)
    joined: Tensor = outputs[rank]
    return joined


def _join(records: list[_Record]) -> list[Tensor]:
    """Make the replicas' overwritten inputs the outputs of ONE autograd node (runs once, in one thread)."""
    if not any(r.needs_grad for r in records):
        return [r.y for r in records]
    tensors = [r.y for r in records] + [r.weight for r in records] + [r.bias for r in records]
    with torch.enable_grad():
        outputs = _JointInPlaceABN.apply(records, *tensors)
    return list(outputs)


class _JointInPlaceABN(torch.autograd.Function):
    """Marks every replica's overwritten input dirty in forward; joint backward of all replicas."""

    @staticmethod
    def forward(ctx: Any, records: list[_Record], *tensors: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        size = len(records)
        ctx.size = size
        ctx.meta = [(r.stats, r.eps, r.activation, r.param) for r in records]
        ys = [r.y for r in records]
        ctx.mark_dirty(*ys)
        ctx.save_for_backward(*tensors)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(_abn.DOUBLE_BACKWARD)
        size = ctx.size
        saved = ctx.saved_tensors
        ys, weights, biases = saved[:size], saved[size : 2 * size], saved[2 * size :]
        needs = ctx.needs_input_grad[1:]
        parts = []
        for k in range(size):
            stats, eps, activation, param = ctx.meta[k]
            parts.append(
                _abn.local_sums(ys[k], grads[k], weights[k], biases[k], eps, activation, param, stats)
            )
        reduced = ordered_sum([_math.pack_grad_sums(p[2], p[3]) for p in parts])  # replica order
        grad_inputs, grad_weights, grad_biases = [], [], []
        for k in range(size):
            stats, eps, _, _ = ctx.meta[k]
            recovered, dz, sum_dz, sum_dz_xhat = parts[k]
            gi, gw, gb = _abn.finish_grads(
                ys[k],
                weights[k],
                biases[k],
                eps,
                stats,
                recovered,
                dz,
                sum_dz,
                sum_dz_xhat,
                reduced,
                (needs[k], needs[size + k], needs[2 * size + k]),
            )
            grad_inputs.append(gi)
            grad_weights.append(gw)
            grad_biases.append(gb)
        return (None, *grad_inputs, *grad_weights, *grad_biases)
