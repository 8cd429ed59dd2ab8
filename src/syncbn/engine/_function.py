"""The eager engine: what every family's synchronised training step shares.

The moments and count rules, the framed sum and the Join policy, the family's forward and
the running update, and the autograd Functions (eager and ``torch.func``) of every family. See
docs/architecture.md for one step through them, docs/internals/engine.md for the details.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from .. import _accumulating, _checks, _config
from .._threads import LOCAL, ThreadSumGroup
from ..families._protocol import THIS_CALL
from ..families.inplace_abn import DOUBLE_BACKWARD, InPlaceABN, check_call
from ..groups import (
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OTHER,
    CollectiveError,
    ProcessGroupSum,
    SumGroup,
    Tag,
)
from . import _math
from ._double_backward import differentiable_backward, reduce_unwrapped
from ._math import Stats, finish_input_grad, local_grad_sums
from ._rules import gradient_dtype, is_compiling, one_value_error, statistics_dtype


class Params(NamedTuple):
    """A training call's arguments besides the tensors autograd tracks (direct arguments of
    ``Function.apply``), built once at the entry; carried through the engine eager and traced alike."""

    running_mean: Tensor | None  # updated in place (None: not tracked)
    running_var: Tensor | None  # updated in place, with the unbiased variance
    eps: float
    momentum: Any  # a float (traced: a 0-dim tensor for a cumulative average)
    group: Any = None  # eager: a SumGroup (None: no collective); traced: a group handle (0: none)
    layer: Any = None  # eager: the calling layer (errors, handshake state); traced: its token
    family: Any = None  # the family's per-call object (syncbn.families); None: batch norm
    statistics: Any = THIS_CALL  # what it normalises with (syncbn.families._protocol.Statistics)


def _expected_more_than_one(x: Tensor, group: SumGroup, layer: Any, family: Any = None) -> ValueError:
    members = "member(s) of the group" if family is not None and family.in_place else "ranks of the group"
    return one_value_error(x, group.size, members, layer)


class Moments(NamedTuple):
    """The global statistics of a training call (statistics dtype), as the engine computed them."""

    mean: Tensor
    var: Tensor  # biased
    unbiased: Tensor
    total: float | Tensor  # global count: a float on the host, a 0-dim float64 tensor on a device
    local_count: int  # this member's values per channel
    global_count: float  # the global count, or the lower bound 2.0 when this member holds >= 2

    def update_running(self, params: Params) -> None:
        """The update of ``params``' running statistics (none for an empty global batch)."""
        if self.global_count > 0:  # (syncbn.accumulation sees every update here)
            running_mean, momentum = params.running_mean, params.momentum
            replicas = isinstance(params.group, ThreadSumGroup)
            _accumulating.observe(running_mean, self.total, self.mean, self.var, momentum, local=replicas)
            _math.update_running(running_mean, params.running_var, self.mean, self.unbiased, momentum)


def synchronized_moments(
    x: Tensor,
    stat_dtype: torch.dtype,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
    scratch: Tensor | None = None,
    statistics: Any = THIS_CALL,
) -> Moments:
    """Local moments, packed; ONE ``reduce`` (``None``: this member alone); ``statistics.pool``; the
    statistics to normalise with. A global count of one raises ``one_value_error()`` first."""
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
    return Moments(mean, var, unbiased, total, count, global_count)


_PHASE_CODES = {"forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}

# The active syncbn.join.JoinableSyncBatchNorm while a Join context holds one, else None.
_joining: Any = None


def through_join(group: Any) -> bool:
    """Whether ``group``'s collectives go through the active Join's joinable (then the checks are skipped)."""
    global _joining
    if _joining is None or not isinstance(group, ProcessGroupSum) or group.process_group is not None:
        return False
    if not _joining.live():  # its Join ended through an exception (no post-hook ran): join mode ends
        _joining = None
        return False
    return True


def checks_before_forward(group: Any, layer: Any, x: Tensor) -> int:
    """The handshake or debug check before a forward collective; the debug call number (0: none)."""
    return 0 if through_join(group) else _checks.before_forward(group, layer, x)


def checks_before_backward(group: Any, layer: Any, grad_output: Tensor, call: int) -> None:
    """Debug mode's check before a backward collective, under the Join policy."""
    if not through_join(group):
        _checks.before_backward(group, layer, grad_output, call)


def _all_reduce(group: SumGroup, tensor: Tensor, layer: Any, phase: str) -> Tensor:
    """Sum ``tensor`` over ``group``, framed with the layer's identity and ``phase``: every collective."""
    try:
        if through_join(group):
            return _joining.all_reduce(tensor)
        if type(group) is ProcessGroupSum:
            tag = Tag(_checks.layer_identity(layer, group), _PHASE_CODES.get(phase, PHASE_OTHER))
            deferred = not _host_side(tensor) and not _config.debug_enabled()
            return group.all_reduce_sum(tensor, tag, deferred=deferred)
        return group.all_reduce_sum(tensor)
    except CollectiveError as exc:
        raise exc.for_layer(_checks.layer_name(layer), phase) from exc.__cause__


def _host_side(x: Tensor) -> bool:
    """Whether ``x`` is in host memory: the one switch between CPU and accelerator flows (tests flip it)."""
    return x.is_cpu  # (``device.type`` makes a device object: ~0.2 us a call)


class ForwardResult(NamedTuple):
    """What a synchronised training forward produced, and what its backward needs."""

    out: Tensor  # the output (the in-place family: the input, overwritten)
    stats: Any  # what backward reads: a syncbn.engine._math.Stats, or the family's (in-place: ABNStats)
    weight: Tensor | None = None  # the weight the elementwise forward used (the family's effective one)
    correction: tuple[Tensor, Tensor] | None = None  # the family's (r, d); None for batch norm


def synchronized_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    params: Params,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
) -> ForwardResult:
    """The training forward with statistics summed by ``reduce``: the output and what backward needs.

    Shared by the process-group path and the DataParallel replicas; ``reduce`` is the transport
    (``params.group`` is not read). ``reduce`` ``None`` (this member alone): the in-place family only.
    """
    family, eps = params.family, params.eps
    stat_dtype = statistics_dtype(x, weight, params.running_mean)
    if family is not None and family.in_place:  # written over x: eval, nn.BatchNorm's kernel alone, or synced
        running_mean, running_var = params.running_mean, params.running_var
        if not family.training:  # the running statistics (total 0: no update)
            assert running_mean is not None and running_var is not None  # (checked by check_call)
            count = x.numel() // x.shape[1] if x.shape[1] else 0
            mean, var = _math.cast(running_mean, stat_dtype), _math.cast(running_var, stat_dtype)
            stats = family.forward_(x, weight, bias, Moments(mean, var, var, 0.0, count, 0.0), eps)
        elif reduce is None and params.statistics is THIS_CALL and x.shape[1] and x.numel() // x.shape[1] > 1:
            stats = family.native_forward_(
                x, weight, bias, running_mean, running_var, params.momentum, eps, stat_dtype
            )
        else:
            moments = synchronized_moments(x, stat_dtype, reduce, one_value_error, None, params.statistics)
            stats = family.forward_(x, weight, bias, moments, eps)
            moments.update_running(params)
        return ForwardResult(x, stats, weight, None)
    # On CPU the output buffer is the two-pass moments' scratch space (the native kernel needs none).
    out = torch.empty_like(x) if _host_side(x) and not _math.uses_native_statistics(x) else None
    moments = synchronized_moments(x, stat_dtype, reduce, one_value_error, out, params.statistics)
    mean, var = moments.mean, moments.var
    correction = None if family is None else family.correction(mean, var, eps)
    if correction is not None:  # the family's effective affine map, from statistics before the update
        weight, bias = family.affine(weight, bias, *correction)
    if moments.local_count > 0:
        out = _math.normalize(x, weight, bias, mean, var, eps, out=out)
    elif out is None:
        out = torch.empty_like(x)
    moments.update_running(params)
    stats = Stats(mean, var, eps, moments.total, moments.local_count)
    return ForwardResult(out, stats, weight, correction)


class _Pending:
    """A forward's result, handed to ``setup_context`` (whose ``forward`` has no ``ctx``)."""

    __slots__ = ("result", "call")

    def __init__(self) -> None:
        self.result: Any = None
        self.call = 0


def run_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params
) -> tuple[ForwardResult, int]:
    """The training forward over ``params.group`` (``None``: no collective, no check), and the call number."""
    group, layer = params.group, params.layer
    call, reduce = 0, None
    if group is not None:
        call = checks_before_forward(group, layer, x)
        reduce = lambda packed: _all_reduce(group, packed, layer, "forward")  # noqa: E731

    def error() -> ValueError:
        return _expected_more_than_one(x, LOCAL if group is None else group, layer, params.family)

    return synchronized_forward(x, weight, bias, params, reduce, error), call


def _save(
    ctx: Any, x: Tensor, weight: Any, bias: Any, result: ForwardResult, params: Params, call: int
) -> None:
    if params.family is not None and params.family.in_place:  # only the output (the input, overwritten)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias)
    elif result.correction is None:
        ctx.save_for_backward(x, result.weight)
    else:  # also the layer's own weight: the double backward differentiates through it
        ctx.save_for_backward(x, result.weight, weight)
    ctx.stats, ctx.family, ctx.correction = result.stats, params.family, result.correction
    ctx.param_dtype = gradient_dtype(weight, bias, x)  # (read only where a parameter needs a gradient)
    ctx.params, ctx.call = params, call


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    stats, family, group, layer = ctx.stats, ctx.family, ctx.params.group, ctx.params.layer
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    if family is not None and family.in_place:
        if torch.is_grad_enabled():  # the output it recovers from is not differentiable again
            return _in_place_backward_under_func(ctx, grad_output)
        grad_input, sum_dy_xhat, sum_dy = _in_place_backward(ctx, grad_output, family, stats, need_input)
    else:
        saved = ctx.saved_tensors
        x, weight = saved[0], saved[1]
        if torch.is_grad_enabled() and stats.total:
            # create_graph=True: every rank takes this branch alike (same create_graph and count).
            checks_before_backward(group, layer, grad_output, ctx.call)
            if ctx.correction is not None:  # the effective scale from the differentiable weight
                weight = family.scale(saved[2], ctx.correction[0])
            reduce = lambda t, phase: _all_reduce(group, t, layer, phase)  # noqa: E731
            return differentiable_backward(
                ctx, grad_output, x, weight, reduce, ctx.params.statistics is not THIS_CALL
            )
        sum_dy, sum_dy_xhat = local_grad_sums(grad_output, x, weight, stats)
        grad_input = None
        if need_input:
            checks_before_backward(group, layer, grad_output, ctx.call)
            reduced = _all_reduce(group, _math.pack_grad_sums(sum_dy, sum_dy_xhat), layer, "backward")
            grad_input = finish_input_grad(grad_output, x, weight, stats, reduced)
        if ctx.correction is not None:
            sum_dy_xhat, sum_dy = family.parameter_grads(sum_dy, sum_dy_xhat, *ctx.correction)
    grad_weight = _math.cast(sum_dy_xhat, ctx.param_dtype) if need_weight else None
    grad_bias = _math.cast(sum_dy, ctx.param_dtype) if need_bias else None
    return grad_input, grad_weight, grad_bias


def _in_place_backward(
    ctx: Any, grad: Tensor, family: Any, stats: Any, need_input: bool
) -> tuple[Tensor | None, Tensor, Tensor]:
    """``(grad_input, dweight, dbias)`` of the in-place family: from its saved output, ONE framed sum."""
    y, weight, bias = ctx.saved_tensors
    group, layer = ctx.params.group, ctx.params.layer
    # this process alone, its own statistics: one native call
    if group is None and stats.training and stats.local_count > 1 and ctx.params.statistics is THIS_CALL:
        grad_input, sum_dz, sum_dz_xhat = family.native_backward(y, grad, weight, bias, stats, need_input)
    else:
        carry, sum_dz, sum_dz_xhat = family.grad_sums(y, grad, weight, bias, stats)
        reduced = None  # eval: the statistics are constants
        if need_input and stats.training:
            reduced = _math.pack_grad_sums(sum_dz, sum_dz_xhat)
            if group is not None:
                checks_before_backward(group, layer, grad, ctx.call)
                if torch._C._are_functorch_transforms_active():  # the plain tensors (torch.func.grad)
                    reduced = reduce_unwrapped(reduced, lambda t, phase: _all_reduce(group, t, layer, phase))
                else:
                    reduced = _all_reduce(group, reduced, layer, "backward")
        grad_input = family.input_grad(y, weight, bias, stats, carry, reduced) if need_input else None
    return (grad_input, *family.parameter_grads(sum_dz, sum_dz_xhat, weight))


def _in_place_backward_under_func(
    ctx: Any, grad_output: Tensor
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The in-place family's backward with grad on: refused, except after a forward under torch.func,
    whose ``grad``/``vjp`` build the backward's graph (``vjp``'s function after the transform exited):
    each gradient computed without it, behind a node that refuses a second differentiation."""
    if not (torch._C._are_functorch_transforms_active() or getattr(ctx, "transformed", False)):
        raise RuntimeError(DOUBLE_BACKWARD)
    with torch.no_grad():
        grads = _backward(ctx, grad_output)
    y, weight, _ = ctx.saved_tensors  # (what the gradients depend on: the node is recorded if any does)
    gi, gw, gb = (None if g is None else _FirstOrderOnly.apply(g, y, weight, grad_output) for g in grads)
    return gi, gw, gb


class _FirstOrderOnly(torch.autograd.Function):
    """``grad`` unchanged; differentiating it again raises (the in-place family's double backward)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad: Tensor, *depends_on: Tensor | None) -> Tensor:  # type: ignore[override]
        return grad.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        raise RuntimeError(DOUBLE_BACKWARD)


IN_PLACE_VMAP = (
    "syncbn: torch.func.vmap over an in-place activated batch norm (InPlaceSyncBatchNorm, "
    "InPlaceABN, InPlaceABNSync) expected eval mode with running statistics and an unbatched "
    "weight and bias (got {got}): batch statistics would be each vmapped sample's own (and, "
    "synchronised, a collective per sample). Under vmap use the layer in eval mode, or "
    "syncbn.SyncBatchNorm followed by the activation; torch.func.grad/vjp/jacrev are supported."
)


def _in_place_vmap(in_dims: Any, x: Tensor, weight: Any, bias: Any, params: Params, box: _Pending) -> Any:
    """The in-place family under ``vmap``: in eval (constant statistics) the vmapped dim joins the batch.

    ``box`` is the caller's: a transform above ``vmap`` (``grad``) reads the forward's result from it.
    """
    x_dim, weight_dim, bias_dim = in_dims[:3]
    if params.family.training or weight_dim is not None or bias_dim is not None or x_dim is None:
        got = "batch statistics (training, or eval without running statistics)"
        if not params.family.training:
            got = "an unbatched input" if x_dim is None else "a batched weight or bias"
        raise NotImplementedError(IN_PLACE_VMAP.format(got=got))
    moved = x.movedim(x_dim, 0)
    contiguous = moved.is_contiguous()  # then a view: written over in place, else a copy written back
    flat = moved.view(-1, *moved.shape[2:]) if contiguous else moved.reshape(-1, *moved.shape[2:]).clone()
    TransformableSyncBatchNormFunction.apply(flat, weight, bias, params, box)
    if not contiguous:
        moved.copy_(flat.view(moved.shape))
    return x, x_dim


class SyncBatchNormFunction(torch.autograd.Function):
    """A training call of any family over ``group``; eager form (``setup_context`` costs a bind per call)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> Tensor:  # type: ignore[override]
        result, call = run_forward(x, weight, bias, params)
        _save(ctx, x, weight, bias, result, params, call)
        return result.out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*_backward(ctx, grad_output), None)


class TransformableSyncBatchNormFunction(torch.autograd.Function):
    """:class:`SyncBatchNormFunction` in the ``setup_context`` form ``torch.func`` needs (``vmap`` raises)."""

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params, box: _Pending
    ) -> Tensor:  # type: ignore[override]
        box.result, box.call = run_forward(x, weight, bias, params)
        return box.result.out

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
        x, weight, bias, params, box = args
        if params.family is not None and params.family.in_place:
            return _in_place_vmap(in_dims, x, weight, bias, params, box)
        raise NotImplementedError(
            "syncbn: torch.func.vmap over a synchronised SyncBatchNorm in training is not supported "
            "(each vmapped sample would need its own collective across ranks). Use the layer in eval "
            "mode, or outside a process group, under vmap; torch.func.grad/vjp/jacrev are supported."
        )


def inplace_abn_apply(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    param: float,
    group: SumGroup | None,
    layer: Any = None,
    statistics: Any = THIS_CALL,
) -> Tensor:
    """In-place activated batch norm on the engine, over ``group`` in training; returns ``x``, overwritten."""
    check_call(x, weight, running_mean, running_var, training)
    family = InPlaceABN(activation, param, training)
    group = group if training else None
    params = Params(running_mean, running_var, eps, momentum, group, layer, family, statistics)
    return apply(x, weight, bias, params)


# SyncBatchNormFunction.apply's C entry, bound once. Outside torch.func and tracing, Function.apply's
# Python wrapper only unwraps dead functorch wrappers: ``apply`` does that itself, ~3 us less.
_unwrap_if_dead: Any = getattr(torch._C._functorch, "unwrap_if_dead", None)
_apply_entry: Any = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_apply_c: Any = None
if _unwrap_if_dead is not None and _apply_entry is not None:
    _apply_c = _apply_entry.__get__(None, SyncBatchNormFunction)


def apply(x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> Tensor:
    """The engine's autograd Function applied (every family's training call; the layers' input
    already checked): the ``setup_context`` form under torch.func's transforms, else the C entry."""
    if torch._C._are_functorch_transforms_active():  # torch.func.grad / vjp / vmap
        return TransformableSyncBatchNormFunction.apply(x, weight, bias, params, _Pending())
    if _apply_c is None or is_compiling():
        return SyncBatchNormFunction.apply(x, weight, bias, params)  # type: ignore[no-any-return]
    unwrap = _unwrap_if_dead
    weight = None if weight is None else unwrap(weight)
    bias = None if bias is None else unwrap(bias)
    return _apply_c(unwrap(x), weight, bias, params)  # type: ignore[no-any-return]
