"""The eager engine: what every family's synchronised training step shares.

Forward: :func:`synchronized_moments` (local moments, packed; ONE framed sum;
the count rules), the family's elementwise forward (:func:`synchronized_forward`:
batch norm, renorm's effective affine map, or the in-place family writing over
its input, :mod:`syncbn.families`) and the running-statistics update. Backward:
the family's local sums, ONE framed sum, its input and parameter gradients.
The framed sum (:func:`_all_reduce`) and the Join policy (:func:`through_join`,
:func:`checks_before_forward`, :func:`checks_before_backward`) live here once,
for every family and path. Device-to-host reads only on a rank holding fewer
than two values per channel (then every rank whose global count is below two
decides alike).

Two autograd entry points, for every family, both ``apply(x, weight, bias,
params)`` with one :class:`Params` for everything else: :class:`SyncBatchNormFunction`
(eager) and :class:`TransformableSyncBatchNormFunction` (``setup_context``
form, under ``torch.func``; with ``create_graph=True`` the backward is
differentiable, :mod:`syncbn.engine._double_backward`). Compiled models run
:mod:`syncbn.engine._compiled` (on the same :class:`Params`, in their traced form), whose only
call here is the framed sum (:mod:`syncbn.engine._ops`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from .. import _accumulating, _checks, _config
from .._threads import LOCAL
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
from ._double_backward import differentiable_backward
from ._math import Stats, finish_input_grad, local_grad_sums
from ._rules import gradient_dtype, one_value_error, statistics_dtype

__all__ = ["LOCAL", "Params", "SyncBatchNormFunction", "inplace_abn_apply", "synchronized_forward"]


class Params(NamedTuple):
    """A training call's arguments besides the tensors autograd tracks, as one object.

    Built once at the entry (the layers' eager and compiled forwards,
    :func:`syncbn.functional.sync_batch_norm`, a DataParallel replica,
    :func:`inplace_abn_apply`) and carried through every layer of the engine,
    eager and traced alike; ``x``, ``weight`` and ``bias`` stay direct arguments
    of ``Function.apply``.
    """

    running_mean: Tensor | None  # updated in place (None: not tracked)
    running_var: Tensor | None  # updated in place, with the unbiased variance
    eps: float
    momentum: Any  # a float (traced: a 0-dim tensor for a cumulative average)
    group: Any = None  # eager: a SumGroup (None: no collective); traced: a group handle (0: none)
    layer: Any = None  # eager: the calling layer (errors, handshake state); traced: its token
    family: Any = None  # the family's per-call object (syncbn.families); None: batch norm


def _expected_more_than_one(x: Tensor, group: SumGroup, layer: Any, family: Any = None) -> ValueError:
    in_place = family is not None and family.in_place
    return one_value_error(
        x, group.size, "member(s) of the group" if in_place else "ranks of the group", layer
    )


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
            _accumulating.observe(running_mean, self.total, self.mean, self.var, momentum)
            _math.update_running(running_mean, params.running_var, self.mean, self.unbiased, momentum)


def synchronized_moments(
    x: Tensor,
    stat_dtype: torch.dtype,
    reduce: Callable[[Tensor], Tensor] | None,
    one_value_error: Callable[[], Exception],
    scratch: Tensor | None = None,
) -> Moments:
    """Local moments, packed; ONE ``reduce``; the global statistics; the count rules.

    Local count, mean and M2 (stable two-pass, at least float32), packed in
    float64 as ``[n, n*m, M2 + n*m^2]`` (on the host in this thread's reusable
    buffer), summed by ``reduce`` (``None``: this member alone), unpacked into the
    statistics dtype; a global count of one raises ``one_value_error()`` before
    anything changes.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    host = _host_side(x)
    # On the host, the packed vector and its views are this thread's, reused every call.
    buffer = _math.moment_buffer(channels, x.device) if host else None
    if count > 0:
        mean_l, var_l = _math.local_moments(x, scratch=scratch)
        packed = _math.pack_moments(count, mean_l, var_l, channels=channels, device=x.device, buffer=buffer)
    else:
        packed = _math.pack_moments(0, None, None, channels=channels, device=x.device, buffer=buffer)
    if reduce is not None:
        packed = reduce(packed)
    total, (mean, var, unbiased) = _math.unpack_moments(
        packed, channels, read_count=host, dtype=stat_dtype, buffer=buffer
    )
    # Nothing has changed yet: the one-value error still leaves every state as it was.
    global_count = 2.0  # a lower bound is all that is needed when count >= 2
    if count < 2:
        # A device read only here, where the count may be below two.
        global_count = total if isinstance(total, float) else float(total.item())
        if global_count == 1:
            raise one_value_error()
    return Moments(mean, var, unbiased, total, count, global_count)


_PHASE_CODES = {"forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}

# The active syncbn.join.JoinableSyncBatchNorm while a Join context holds one, else None.
_joining: Any = None


def through_join(group: Any) -> bool:
    """Whether ``group``'s collectives go through the active Join's joinable (:mod:`syncbn.join`).

    The Join policy, once for every family and path: under Join the default
    group's collectives become the joinable's header-then-payload exchange (its
    header checks that the training ranks agree; a joined rank answers only
    those), and the per-call checks (handshake, debug mode), which a joined rank
    would never answer, are skipped.
    """
    return _joining is not None and isinstance(group, ProcessGroupSum) and group.process_group is None


def checks_before_forward(group: Any, layer: Any, x: Tensor) -> int:
    """The handshake or debug check before a forward collective, under the Join policy.

    Returns the call number recorded for debug mode (0 when none, or under Join).
    """
    if through_join(group):
        return 0
    return _checks.before_forward(group, layer, x)


def checks_before_backward(group: Any, layer: Any, grad_output: Tensor, call: int) -> None:
    """Debug mode's check before a backward collective, under the Join policy."""
    if not through_join(group):
        _checks.before_backward(group, layer, grad_output, call)


def _all_reduce(group: SumGroup, tensor: Tensor, layer: Any, phase: str) -> Tensor:
    """Sum ``tensor`` over ``group``, framed with the call's identity (:mod:`syncbn.groups`).

    Every collective of a layer goes through here: over a process group the frame
    carries the layer's identity, the phase, dtype and size, checked on every rank
    (on an accelerator at the group's next call, so that no device-to-host
    synchronisation is added; at once in debug mode).
    """
    try:
        if through_join(group):
            # Under Join: through the joinable's own group, a joined rank shadowing (syncbn.join).
            result: Tensor = _joining.all_reduce(tensor)
            return result
        if type(group) is ProcessGroupSum:
            tag = Tag(_checks.layer_identity(layer, group), _PHASE_CODES.get(phase, PHASE_OTHER))
            deferred = not _host_side(tensor) and not _config.debug_enabled()
            return group.all_reduce_sum(tensor, tag, deferred=deferred)
        return group.all_reduce_sum(tensor)
    except CollectiveError as exc:
        raise exc.for_layer(_checks.layer_name(layer), phase) from exc.__cause__


def _host_side(x: Tensor) -> bool:
    """Whether ``x`` lives in host memory (reading a value back costs no device synchronisation).

    The one switch between the CPU and accelerator flows; tests flip it to run the latter on CPU.
    """
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
    """The training forward of ``x`` with statistics summed by ``reduce``: output and what backward needs.

    The transport-independent forward shared by the process-group path
    (:class:`SyncBatchNormFunction`) and the ``nn.DataParallel`` replicas
    (:mod:`syncbn.parallel`): local moments, one ``reduce`` of the packed
    moments (``None``: this member alone, the in-place family only), the
    family's elementwise forward (batch norm, ``params.family`` ``None``:
    normalisation into a freshly allocated output, which also served as the
    moments' scratch buffer) and the update of ``params``' running statistics
    (``running_var`` unbiased); ``one_value_error()`` is raised for a global
    count of one. ``params.group`` is not read here: ``reduce`` is the
    transport. Every per-channel step is a single tensor operation on all
    channels at once: on small layers the number of operations, not the bytes,
    sets the time.
    """
    family, eps = params.family, params.eps
    stat_dtype = statistics_dtype(x, weight, params.running_mean)
    if family is not None and family.in_place:  # written over x: eval, nn.BatchNorm's kernel alone, or synced
        running_mean, running_var = params.running_mean, params.running_var
        if not family.training:
            stats = family.eval_forward_(x, weight, bias, running_mean, running_var, eps, stat_dtype)
        elif reduce is None and x.shape[1] and x.numel() // x.shape[1] > 1:
            momentum = params.momentum
            stats = family.native_forward_(
                x, weight, bias, running_mean, running_var, momentum, eps, stat_dtype
            )
        else:
            moments = synchronized_moments(x, stat_dtype, reduce, one_value_error)
            stats = family.forward_(x, weight, bias, moments, eps)
            moments.update_running(params)
        return ForwardResult(x, stats, weight, None)
    # On CPU the output buffer doubles as the moments' scratch space of the two-pass
    # statistics (see local_moments); the native kernel (CUDA, small or 16-bit input) needs none,
    # and the normalisation then allocates its own output.
    out = torch.empty_like(x) if _host_side(x) and not _math.uses_native_statistics(x) else None
    moments = synchronized_moments(x, stat_dtype, reduce, one_value_error, scratch=out)
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
    """The synchronised training forward over ``params.group``, and the debug call number.

    ``group`` ``None`` (the in-place family without a group, and eval): no collective, no check.
    """
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
    else:
        ctx.save_for_backward(x, result.weight)
    ctx.stats, ctx.family, ctx.correction = result.stats, params.family, result.correction
    ctx.param_dtype = gradient_dtype(weight, bias, x)  # (read only where a parameter needs a gradient)
    ctx.params, ctx.call = params, call


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    stats, family, group, layer = ctx.stats, ctx.family, ctx.params.group, ctx.params.layer
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    if family is not None and family.in_place:
        if torch.is_grad_enabled():  # the output it recovers from is not differentiable again
            raise RuntimeError(DOUBLE_BACKWARD)
        grad_input, sum_dy_xhat, sum_dy = _in_place_backward(ctx, grad_output, family, stats, need_input)
    else:
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled() and stats.total:
            # create_graph=True (gradient penalties, torch.func.grad): a backward that is itself
            # differentiable. Every rank takes this branch alike (same create_graph, same global count).
            checks_before_backward(group, layer, grad_output, ctx.call)
            return differentiable_backward(
                ctx, grad_output, x, weight, lambda t, phase: _all_reduce(group, t, layer, phase)
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
    if group is None and stats.training and stats.local_count > 1:  # this process alone: one native call
        grad_input, sum_dz, sum_dz_xhat = family.native_backward(y, grad, weight, bias, stats, need_input)
    else:
        carry, sum_dz, sum_dz_xhat = family.grad_sums(y, grad, weight, bias, stats)
        reduced = None  # eval: the statistics are constants
        if need_input and stats.training:
            reduced = _math.pack_grad_sums(sum_dz, sum_dz_xhat)
            if group is not None:
                checks_before_backward(group, layer, grad, ctx.call)
                reduced = _all_reduce(group, reduced, layer, "backward")
        grad_input = family.input_grad(y, weight, bias, stats, carry, reduced) if need_input else None
    return (grad_input, *family.parameter_grads(sum_dz, sum_dz_xhat, weight))


class SyncBatchNormFunction(torch.autograd.Function):
    """A training call of any family whose statistics span every member of ``group``.

    Batch norm's backward is differentiable with ``create_graph=True`` (through
    differentiable all_reduces). The eager form (``forward`` takes ``ctx``:
    ``setup_context`` costs an ``inspect.signature`` bind per call, ~0.15 ms);
    under ``torch.func`` :class:`TransformableSyncBatchNormFunction` runs instead.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params) -> Tensor:  # type: ignore[override]
        result, call = run_forward(x, weight, bias, params)
        _save(ctx, x, weight, bias, result, params, call)
        return result.out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*_backward(ctx, grad_output), None)


class TransformableSyncBatchNormFunction(torch.autograd.Function):
    """:class:`SyncBatchNormFunction` in the ``setup_context`` form ``torch.func`` needs.

    ``torch.func.grad``, ``vjp``, ``jacrev`` run through it; ``vmap`` raises. ``box``
    is a fresh :class:`_Pending` per call: the forward's result for ``setup_context``.
    """

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor | None, bias: Tensor | None, params: Params, box: _Pending
    ) -> Tensor:  # type: ignore[override]
        box.result, box.call = run_forward(x, weight, bias, params)
        out: Tensor = box.result.out
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, weight, bias, params, box = inputs
        _save(ctx, x, weight, bias, box.result, params, box.call)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*_backward(ctx, grad_output), None, None)

    @staticmethod
    def vmap(info: Any, in_dims: Any, *args: Any) -> Any:
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
) -> Tensor:
    """In-place activated batch norm (:class:`~syncbn.families.inplace_abn.InPlaceABN`) on the engine.

    Checks first; over ``group`` in training (``None``: alone); returns ``x``, overwritten.
    """
    check_call(x, weight, running_mean, running_var, training)
    family = InPlaceABN(activation, param, training)
    params = Params(running_mean, running_var, eps, momentum, group if training else None, layer, family)
    out: Tensor = SyncBatchNormFunction.apply(x, weight, bias, params)
    return out
