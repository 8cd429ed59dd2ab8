"""The eager engine: every family's training step and autograd Functions (docs/architecture.md)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from .. import _accumulating, _checks, _config
from .._threads import LOCAL
from ..families._protocol import THIS_CALL, Record
from ..families.batchnorm import BATCH_NORM
from ..groups import PHASE_BACKWARD, PHASE_FORWARD, PHASE_OTHER, CollectiveError, Tag
from . import _math
from ._double_backward import differentiable_backward, reduce_unwrapped
from ._rules import gradient_dtype, is_compiling, one_value_error, statistics_dtype


class Params(NamedTuple):
    """A training call's arguments besides the tensors autograd tracks, eager and traced alike."""

    running_mean: Tensor | None  # updated in place (None: not tracked)
    running_var: Tensor | None  # updated in place, with the unbiased variance
    eps: float
    momentum: Any  # a float (traced: a 0-dim tensor for a cumulative average)
    group: Any = None  # eager: a SumGroup (None: no collective); traced: a group handle (0: none)
    layer: Any = None  # eager: the calling layer (errors, handshake state); traced: its token
    family: Any = BATCH_NORM  # the family's per-call object (syncbn.families._protocol.Family), never None
    statistics: Any = THIS_CALL  # what it normalises with (syncbn.families._protocol.Statistics)


def _expected_more_than_one(x: Tensor, group: Any, layer: Any, family: Any = BATCH_NORM) -> ValueError:
    return one_value_error(x, group.size, family.members, layer)


def update_running(moments: Record, params: Params) -> None:
    """The update of ``params``' running statistics with ``moments`` (none for an empty global batch)."""
    if moments.global_count > 0:  # (syncbn.accumulation sees every update here)
        running_mean, momentum = params.running_mean, params.momentum
        local = getattr(params.group, "replicas", False)  # (DataParallel replicas' moments)
        _accumulating.observe(running_mean, moments.total, moments.mean, moments.var, momentum, local=local)
        _math.update_running(running_mean, params.running_var, moments.mean, moments.unbiased, momentum)


def synchronized_moments(
    x: Tensor,
    stat_dtype: torch.dtype,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
    eps: float,
    scratch: Tensor | None = None,
    statistics: Any = THIS_CALL,
) -> Record:
    """Local moments, packed, ONE ``reduce`` (``None``: alone), ``statistics.pool``: the statistics."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    host = _host_side(x)
    buffer = _math.moment_buffer(channels, x.device) if host else None
    mean_l, var_l = _math.local_moments(x, scratch=scratch) if count > 0 else (None, None)
    packed = _math.pack_moments(count, mean_l, var_l, channels=channels, device=x.device, buffer=buffer)
    if reduce is not None:
        packed = reduce(packed)
    packed = statistics.pool(packed)
    total, (mean, var, unbiased) = _math.unpack_moments(
        packed, channels, read_count=host, dtype=stat_dtype, buffer=buffer
    )
    global_count = 2.0  # a lower bound is all that is needed when count >= 2
    if count < 2:  # the only device read, where the count may be below two
        global_count = total if isinstance(total, float) else float(total.item())
        if global_count == 1:
            raise one_value_error()
    return Record(mean, var, eps, total, count, unbiased, global_count)


_OUT = Record._fields.index("out")
_PHASE_CODES = {"forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}


def _all_reduce(group: Any, tensor: Tensor, layer: Any, phase: str) -> Tensor:
    """Sum ``tensor`` over ``group``; a framed group's frames carry the layer's identity and ``phase``."""
    try:
        if getattr(group, "framed", False):
            tag = Tag(_checks.layer_identity(layer, group), _PHASE_CODES.get(phase, PHASE_OTHER))
            deferred = not _host_side(tensor) and not _config.debug_enabled()
            return group.all_reduce_sum(tensor, tag, deferred=deferred)  # type: ignore[no-any-return]
        return group.all_reduce_sum(tensor)
    except CollectiveError as exc:
        raise exc.for_layer(_checks.layer_name(layer), phase) from exc.__cause__


def _host_side(x: Tensor) -> bool:
    """Whether ``x`` is in host memory: the one switch between CPU and accelerator flows (tests flip it)."""
    return x.is_cpu  # (``device.type`` makes a device object: ~0.2 us a call)


def synchronized_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    params: Params,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
) -> Record:
    """The training forward with statistics summed by ``reduce`` (``None``: alone; ``params.group``
    is not read): the family's record for backward. A family in eval uses the running statistics."""
    family, eps, running_mean = params.family, params.eps, params.running_mean
    stat_dtype = statistics_dtype(x, weight, running_mean)
    if not family.training:  # (checked by the family's layer: the running statistics exist)
        count = x.numel() // x.shape[1] if x.shape[1] else 0
        mean, var = _math.cast(running_mean, stat_dtype), _math.cast(params.running_var, stat_dtype)  # type: ignore[arg-type]
        return family.forward(x, weight, bias, Record(mean, var, eps, 0.0, count, var), None)  # type: ignore[no-any-return]
    if reduce is None and params.statistics is THIS_CALL and x.shape[1] and x.numel() // x.shape[1] > 1:
        native = family.native_forward(x, weight, bias, params, stat_dtype)
        if native is not None:
            return native  # type: ignore[no-any-return]
    # On CPU the output (16-bit: not): one native_batch_norm call (torch.batch_norm's 3), two-pass scratch.
    out = None
    if not family.saves_output and _host_side(x) and x.dtype not in _math._LOW_PRECISION:
        out = torch.empty_like(x) if x.is_contiguous() or not _math.uses_native_statistics(x) else None
    moments = synchronized_moments(x, stat_dtype, reduce, one_value_error, eps, out, params.statistics)
    record = family.forward(x, weight, bias, moments, out)
    update_running(moments, params)
    return record  # type: ignore[no-any-return]


class _Pending:
    """A forward's result, for ``setup_context``."""

    __slots__ = ("result", "call")

    def __init__(self) -> None:
        self.result: Any = None
        self.call = 0


def run_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> tuple[Record, int]:
    """The training forward over ``params.group`` (``None``: no collective), and the call number."""
    group, layer = params.group, params.layer
    call, reduce = 0, None
    if group is not None:
        call = _checks.before_forward(group, layer, x)
        reduce = lambda packed: _all_reduce(group, packed, layer, "forward")  # noqa: E731

    def error() -> ValueError:
        return _expected_more_than_one(x, LOCAL if group is None else group, layer, params.family)

    return synchronized_forward(x, weight, bias, params, reduce, error), call


def _save(ctx: Any, x: Tensor, weight: Any, bias: Any, record: Record, params: Params, call: int) -> None:
    """What backward reads: the saved tensor (input, or output written over it), the weights, the record."""
    family = params.family
    if family.saves_output:
        ctx.mark_dirty(x)
    ctx.save_for_backward(x, record.weight, weight, bias)  # (x: the output, where written over it)
    ctx.record = tuple.__new__(Record, (*record[:_OUT], None, *record[_OUT + 1 :]))  # no output (a cycle)
    ctx.family = family
    ctx.param_dtype = gradient_dtype(weight, bias, x)  # (read only where a parameter needs a gradient)
    ctx.params, ctx.call = params, call


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Every family's backward: its local reduction, ONE framed sum, its input and parameter gradients."""
    record, family, group, layer = ctx.record, ctx.family, ctx.params.group, ctx.params.layer
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    saved, weight, own, bias = ctx.saved_tensors
    if torch.is_grad_enabled() and (record.total or not family.second_order):
        if not family.second_order:  # refused, except as torch.func's first-order backward
            return _first_order_only(ctx, grad_output, saved, own)
        # create_graph=True: every rank takes this branch alike (same create_graph and count).
        _checks.before_backward(group, layer, grad_output, ctx.call)
        weight = family.differentiable_weight(own, record.correction)
        reduce = lambda t, phase: _all_reduce(group, t, layer, phase)  # noqa: E731
        pooled = ctx.params.statistics is not THIS_CALL  # (the variance's derivative centres on its mean)
        return differentiable_backward(ctx, grad_output, saved, weight, reduce, pooled)
    carry, sum_dy, sum_dy_xhat = family.grad_sums(saved, grad_output, weight, bias, record, need_input)
    reduced = None  # constant statistics: none
    if need_input and record.training and not record.native:
        reduced = _math.pack_grad_sums(sum_dy, sum_dy_xhat)
        if group is not None:
            _checks.before_backward(group, layer, grad_output, ctx.call)
            if torch._C._are_functorch_transforms_active():  # the plain tensors (torch.func.grad)
                reduced = reduce_unwrapped(reduced, lambda t, phase: _all_reduce(group, t, layer, phase))
            else:
                reduced = _all_reduce(group, reduced, layer, "backward")
    grad_input = None
    if need_input:
        grad_input = family.input_grad(saved, grad_output, weight, bias, record, carry, reduced)
    sum_dy_xhat, sum_dy = family.parameter_grads(sum_dy, sum_dy_xhat, weight, record.correction)
    grad_weight = _math.cast(sum_dy_xhat, ctx.param_dtype) if need_weight else None
    grad_bias = _math.cast(sum_dy, ctx.param_dtype) if need_bias else None
    return grad_input, grad_weight, grad_bias


def _first_order_only(
    ctx: Any, grad_output: Tensor, saved: Tensor, weight: Any
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """A family without a double backward, backward with grad on: refused, except under torch.func
    (whose ``grad``/``vjp`` record the backward): the gradients behind a node refusing a second one."""
    message = ctx.family.double_backward_error
    if not (torch._C._are_functorch_transforms_active() or getattr(ctx, "transformed", False)):
        raise RuntimeError(message)
    with torch.no_grad():
        grads = _backward(ctx, grad_output)
    # (what the gradients depend on: the node is recorded if any does)
    return tuple(
        None if g is None else _FirstOrderOnly.apply(g, message, saved, weight, grad_output) for g in grads
    )  # type: ignore[return-value]


class _FirstOrderOnly(torch.autograd.Function):
    """``grad`` unchanged; differentiating it again raises ``RuntimeError(message)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad: Tensor, message: str, *depends_on: Tensor | None) -> Tensor:  # type: ignore[override]
        return grad.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.message = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        raise RuntimeError(ctx.message)


def _vmap(in_dims: Any, x: Tensor, weight: Any, bias: Any, params: Params, box: _Pending) -> Any:
    """Under ``vmap``: constant statistics (a family in eval) fold the vmapped dim into the batch;
    else the family's error. ``box``: the caller's, which a transform above ``vmap`` reads."""
    family = params.family
    x_dim, weight_dim, bias_dim = in_dims[:3]
    if family.training or weight_dim is not None or bias_dim is not None or x_dim is None:
        raise NotImplementedError(
            family.vmap_error(x_dim is not None, weight_dim is not None or bias_dim is not None)
        )
    moved = x.movedim(x_dim, 0)
    contiguous = moved.is_contiguous()  # then a view: written over in place, else a copy written back
    flat = moved.view(-1, *moved.shape[2:]) if contiguous else moved.reshape(-1, *moved.shape[2:]).clone()
    out = TransformableSyncBatchNormFunction.apply(flat, weight, bias, params, box)
    if family.saves_output:
        if not contiguous:
            moved.copy_(flat.view(moved.shape))
        return x, x_dim
    return out.view(moved.shape), 0


class SyncBatchNormFunction(torch.autograd.Function):
    """A training call of any family over ``group``; eager form (``setup_context`` costs a bind per call)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> Tensor:  # type: ignore[override]
        record, call = run_forward(x, weight, bias, params)
        _save(ctx, x, weight, bias, record, params, call)
        return record.out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*_backward(ctx, grad_output), None)


class TransformableSyncBatchNormFunction(torch.autograd.Function):
    """:class:`SyncBatchNormFunction` in the ``setup_context`` form ``torch.func`` needs."""

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params, box: _Pending
    ) -> Tensor:  # type: ignore[override]
        box.result, box.call = run_forward(x, weight, bias, params)
        return box.result.out  # type: ignore[no-any-return]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, weight, bias, params, box = inputs
        _save(ctx, x, weight, bias, box.result, params, box.call)
        ctx.transformed = True  # (vjp's function runs its backward after the transform exited)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*_backward(ctx, grad_output), None, None)

    @staticmethod
    def vmap(info: Any, in_dims: Any, *args: Any) -> Any:
        return _vmap(in_dims, *args)


# SyncBatchNormFunction.apply's C entry, bound once. Outside torch.func and tracing, Function.apply's
# Python wrapper only unwraps dead functorch wrappers: ``apply`` does that itself, ~3 us less.
_unwrap_if_dead: Any = getattr(torch._C._functorch, "unwrap_if_dead", None)
_apply_entry: Any = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_apply_c: Any = None
if _unwrap_if_dead is not None and _apply_entry is not None:
    _apply_c = _apply_entry.__get__(None, SyncBatchNormFunction)


def apply(x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> Tensor:
    """The engine's autograd Function applied (input already checked): under torch.func the
    ``setup_context`` form, else the C entry."""
    if torch._C._are_functorch_transforms_active():  # torch.func.grad / vjp / vmap
        return TransformableSyncBatchNormFunction.apply(x, weight, bias, params, _Pending())
    if _apply_c is None or is_compiling():
        return SyncBatchNormFunction.apply(x, weight, bias, params)  # type: ignore[no-any-return]
    unwrap = _unwrap_if_dead
    weight = None if weight is None else unwrap(weight)
    bias = None if bias is None else unwrap(bias)
    return _apply_c(unwrap(x), weight, bias, params)  # type: ignore[no-any-return]
