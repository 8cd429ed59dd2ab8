"""Synchronised batch norm as opaque ``torch.library`` operators, for ``torch.compile``.

The collectives run plain Python (shared memory, bounded waits, handshakes)
that dynamo must not trace. Under ``torch.compile`` a training
:class:`~syncbn.SyncBatchNorm` calls ``syncbn::sync_batch_norm`` instead of the
eager autograd function: one graph node whose fake implementation gives the
shapes, which returns the batch statistics (the running statistics are
updated after it in traced operations: torch refuses an autograd formula on an
operator that mutates its inputs), and whose registered
autograd formula calls ``syncbn::sync_batch_norm_backward``, a second opaque
node holding the backward's collective. Both run the same code as eager
(:func:`syncbn._function.synchronized_forward` and friends), so compiled and
eager results agree bit for bit.

Groups and layers cannot be operator arguments: they are passed as integer
handles into registries here, looked up when the operator runs. The handle is
taken while dynamo traces (``torch._dynamo.assume_constant_result``), so a
compiled graph keeps the group it was traced with; recompile (``torch._dynamo.reset()``)
after replacing the process group.

The eager path does not use these operators: the autograd function costs fewer
dispatcher calls per layer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

try:  # custom operators with ordered side effects: recent torch only
    from torch._library.effects import EffectType

    _register_effectful_op = torch.library._register_effectful_op
    _custom_op = torch.library.custom_op
except (ImportError, AttributeError) as exc:
    raise ImportError(
        "syncbn's torch.compile operators need torch.library.custom_op and ordered effectful "
        f"operators, which torch {torch.__version__} lacks; compiled models then run the eager "
        "layer (with graph breaks)"
    ) from exc

from . import _function, _math, groups

__all__ = ["group_handle", "layer_handle", "sync_batch_norm_op"]

_groups: list[Any] = [None]  # handle -> SumGroup (0: no group, run locally)
_group_ids: dict[int, int] = {}  # id(SumGroup) -> handle
_layers: dict[int, weakref.ref[Any]] = {}  # handle -> layer
_layer_handles: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
calls = 0  # how many times the compiled forward operator ran (diagnostics, tests)
_previous_total: Tensor | None = None  # the last compiled call's count output (an ordering token)


@torch._dynamo.assume_constant_result
def group_handle(process_group: Any) -> int:
    """The integer standing for the group ``process_group`` resolves to now (0: none, run locally)."""
    group = groups.resolve(process_group)
    if group is None:
        return 0
    handle = _group_ids.get(id(group))
    if handle is None or _groups[handle] is not group:
        _groups.append(group)
        handle = _group_ids[id(group)] = len(_groups) - 1
    return handle


@torch._dynamo.assume_constant_result
def layer_handle(layer: Any) -> int:
    """The integer standing for ``layer`` (for error messages and its handshake state)."""
    handle = _layer_handles.get(layer)
    if handle is None:
        handle = len(_layers) + 1
        _layers[handle] = weakref.ref(layer)
        _layer_handles[layer] = handle
    return handle


def _layer(handle: int) -> Any:
    ref = _layers.get(handle)
    return None if ref is None else ref()


@_custom_op("syncbn::sync_batch_norm", mutates_args=())
def _forward_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    after: Tensor | None,
    eps: float,
    group: int,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training forward: ``(out, mean, var, unbiased_var, total)``; ``total`` the 0-dim float64 global count.

    The eager forward exactly, with its running-statistics update turned into
    outputs: a momentum of 1 makes the update write the batch statistics
    themselves (``lerp`` with weight 1 returns its end point bit for bit),
    and a global count of zero leaves them zero. ``after`` (unused) is the
    previous call's count output: a data dependency that keeps the collectives
    in program order even where the compiler sees no other one (an empty
    local batch makes every tensor between two layers an empty allocation).
    """
    global calls
    calls += 1
    dtype = _function.statistics_dtype(x, weight, None)
    batch_mean = x.new_zeros(x.shape[1], dtype=dtype)
    batch_var = x.new_zeros(x.shape[1], dtype=dtype)
    result, _ = _function.run_forward(
        x, weight, bias, batch_mean, batch_var, eps, 1.0, _groups[group], _layer(layer)
    )
    total = result.total
    total = total.clone() if isinstance(total, Tensor) else torch.tensor(total, dtype=torch.float64)
    return result.out, result.mean.clone(), result.var.clone(), batch_var, total


@_forward_op.register_fake
def _forward_fake(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    after: Tensor | None,
    eps: float,
    group: int,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dtype = _function.statistics_dtype(x, weight, None)
    c = x.shape[1]
    mean, var, unbiased = (x.new_empty(c, dtype=dtype) for _ in range(3))
    return torch.empty_like(x), mean, var, unbiased, x.new_empty((), dtype=torch.float64)


@_custom_op("syncbn::sync_batch_norm_backward", mutates_args=())
def _backward_op(
    grad_output: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    var: Tensor,
    total: Tensor,
    eps: float,
    param_dtype: torch.dtype,
    need_input: bool,
    group: int,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)``; ``grad_input`` is empty unless ``need_input``."""
    sum_group, owner = _groups[group], _layer(layer)
    count = x.numel() // x.shape[1] if x.shape[1] else 0
    global_count: float | Tensor = float(total) if _function._host_side(x) else total
    sum_dy, sum_dy_xhat = _function.local_grad_sums(grad_output, x, weight, mean, var, eps, count)
    if need_input:
        reduced = _function._all_reduce(
            sum_group, _math.pack_grad_sums(sum_dy, sum_dy_xhat), owner, "backward"
        )
        grad_input = _function.finish_input_grad(
            grad_output, x, weight, mean, var, eps, global_count, count, reduced
        )
    else:
        grad_input = x.new_empty(0)
    return grad_input, sum_dy_xhat.to(param_dtype), sum_dy.to(param_dtype)


@_backward_op.register_fake
def _backward_fake(
    grad_output: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    var: Tensor,
    total: Tensor,
    eps: float,
    param_dtype: torch.dtype,
    need_input: bool,
    group: int,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_input = torch.empty_like(x) if need_input else x.new_empty(0)
    c = x.shape[1]
    return grad_input, x.new_empty(c, dtype=param_dtype), x.new_empty(c, dtype=param_dtype)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias = inputs[0], inputs[1], inputs[2]
    _, mean, var, unbiased, total = output
    ctx.mark_non_differentiable(mean, var, unbiased, total)
    ctx.save_for_backward(x, weight, mean, var, total)
    ctx.eps, ctx.group, ctx.layer = inputs[4], inputs[5], inputs[6]
    ctx.param_dtype = _function.gradient_dtype(weight, bias, mean)


def _backward(ctx: Any, grad_output: Tensor, *unused: Any) -> tuple[Tensor | None, ...]:
    x, weight, mean, var, total = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_input, grad_weight, grad_bias = _backward_op(
        grad_output.contiguous(memory_format=_memory_format(x)),
        x,
        weight,
        mean,
        var,
        total,
        ctx.eps,
        ctx.param_dtype,
        bool(need_input),
        ctx.group,
        ctx.layer,
    )
    return (
        grad_input if need_input else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
        None,
        None,
        None,
        None,
    )


def _memory_format(x: Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sync_batch_norm_op(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float,
    eps: float,
    group: int,
    layer: int,
) -> Tensor:
    """Training-mode synchronised batch norm through the opaque operator (``group`` a handle > 0).

    The running statistics are updated here, in traceable operations, with the
    batch's global mean and unbiased variance, and only where the global count
    is positive (no host read: the update weight is ``momentum * (count > 0)``).
    """
    global _previous_total
    out, mean, _, unbiased, total = _forward_op(x, weight, bias, _previous_total, eps, group, layer)
    _previous_total = total
    if running_mean is not None or running_var is not None:
        weight_t = (total > 0).to(mean.dtype) * momentum
        for running, batch in ((running_mean, mean), (running_var, unbiased)):
            if running is not None:
                running.lerp_(batch.detach().to(running.dtype), weight_t.to(running.dtype))
    return out


# The collectives are side effects: keep every call, in program order, even where the
# outputs are empty (an empty local batch still takes part) or unused.
for _op in ("syncbn::sync_batch_norm", "syncbn::sync_batch_norm_backward"):
    _register_effectful_op(_op, EffectType.ORDERED)
