"""The collective as one ordered, effectful ``torch.library`` operator, for ``torch.compile``.

Under ``torch.compile`` only the communication is opaque: ``syncbn::all_reduce_sum``
sums a tensor over a syncbn group through the same framed path as eager
(:func:`syncbn.engine._function._all_reduce`: shared memory, the frame check on every
rank, the deferred check on accelerators, ``Join``), while the batch-norm
arithmetic around it is ordinary traced code (:mod:`syncbn.engine._compiled`) that the
compiler fuses. The operator is registered as having *ordered side effects*
(``torch.library._register_effectful_op(..., EffectType.ORDERED)``): AOTAutograd
threads an effect token through every call, so the calls of a graph are never
dropped (an empty local batch still takes part), reordered or merged, in the
forward and in the backward graph alike.

Schema::

    syncbn::all_reduce_sum(Tensor tensor, int group, Tensor? layer, int phase,
                           Tensor? source, int flags) -> Tensor

* ``group``: an integer handle (:func:`group_handle`) standing for a resolved
  group; taken while dynamo traces, it is the same for every layer of a group,
  so it never makes a per-layer guard. A compiled graph keeps the group it was
  traced with: recompile (``torch._dynamo.reset()``) after replacing it.
* ``layer``: the layer's token (:attr:`syncbn._checks.LayerState.token`), a
  0-dim int64 CPU tensor the graph carries as an input: which layer is calling
  is a value, not a guard, so one compiled frame serves every layer. Read on
  the host when the operator runs (no device synchronisation). ``None``: an
  anonymous call.
* ``phase``: :data:`syncbn.groups.PHASE_FORWARD`, ``PHASE_BACKWARD`` or
  ``PHASE_OTHER`` (framed into the header).
* ``source``: the layer's input (forward) or upstream gradient (backward), for
  the first-use handshake and debug mode's checks; ``None`` skips them.
* ``flags``: bit 0 (:data:`CHECK_ONE_VALUE`): the summed tensor's first value
  is the global count; raise the "more than 1 value per channel" ``ValueError``
  on every rank when it is one (a host read, requested only by a rank holding
  fewer than two values per channel, as eager).

The result is always a new tensor; the input is never written. The operator's
autograd formula is its own adjoint (the gradient of a sum over ranks is the
sum over ranks of the gradient), so it may also be differentiated through.

:func:`all_reduce_sum` is the Python entry point for other layers' traced code
(eager: the framed sum directly; compiling: this operator).
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

try:  # operators with ordered side effects: recent torch only (all present on torch 2.13 and 2.15)
    from torch._library.effects import EffectType

    _register_effectful_op = torch.library._register_effectful_op
    _register_fake = torch.library.register_fake
    _AFTER_AUTOGRAD = torch._C._after_autograd_keyset
    _BelowAutograd = torch._C._AutoDispatchBelowAutograd
    _grad_enabled = torch._C.is_grad_enabled
except (ImportError, AttributeError) as exc:
    raise ImportError(
        "syncbn's torch.compile operators need torch.library.register_fake and ordered effectful "
        f"operators, which torch {torch.__version__} lacks; compiled models then run the eager "
        "layer (with graph breaks)"
    ) from exc

from .. import _checks, groups
from ..groups import PHASE_BACKWARD, PHASE_FORWARD, PHASE_NAMES, PHASE_OTHER
from . import _function, _rules

__all__ = [
    "CHECK_ONE_VALUE",
    "all_reduce_sum",
    "group_handle",
    "layer_token",
    "snapshot",
    "tracing_a_checkpointed_region",
]

CHECK_ONE_VALUE = 1  # flags bit: raise the one-value error when the summed count (element 0) is 1

# handle -> a weak reference to its SumGroup (0: no group, run locally; handles are never reused).
# Weak: a group lives as long as syncbn.groups' cache (or the layer) holds it, and is released
# with its process group; a compiled graph still holding the handle of a released group is told so.
_groups: dict[int, Callable[[], Any]] = {}
_group_ids: dict[int, int] = {}  # id(SumGroup) -> handle, while the group lives
_handles = itertools.count(1)
# How many times the operator ran (diagnostics, tests): forward-phase calls (one per layer per
# compiled training forward) and the others (backward, adjoints).
calls = 0
backward_calls = 0

_PHASES = {"forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}

_is_compiling = _rules.is_compiling


@torch._dynamo.assume_constant_result
def group_handle(process_group: Any) -> int:
    """The integer standing for the group ``process_group`` resolves to now (0: none, run locally)."""
    group = groups.resolve(process_group)
    if group is None:
        return 0
    handle = _group_ids.get(id(group))
    if handle is None or group_of(handle) is not group:
        _prune()
        handle = next(_handles)
        try:
            ref: Callable[[], Any] = weakref.ref(group)
        except TypeError:  # a SumGroup that cannot be weakly referenced: held for good
            ref = functools.partial(_identity, group)
        _groups[handle] = ref
        _group_ids[id(group)] = handle
    return handle


def _identity(group: Any) -> Any:
    return group


def group_of(handle: int) -> Any:
    """The live group of ``handle``, or ``None`` (released, closed, or never made)."""
    ref = _groups.get(handle)
    group = None if ref is None else ref()
    return None if group is None or getattr(group, "closed", False) else group


def _prune() -> None:
    """Forget the handles of groups that were released or closed (their process group destroyed)."""
    for handle in [h for h in _groups if group_of(h) is None]:
        del _groups[handle]
    live = {id(g) for g in map(group_of, _groups) if g is not None}
    for key in [k for k in _group_ids if k not in live]:
        del _group_ids[key]


def _live_group(handle: int) -> Any:
    group = group_of(handle)
    if group is None:
        raise groups.CollectiveError(
            "syncbn: a compiled graph calls the collective of a SyncBatchNorm group that no longer "
            "exists (its process group was destroyed, e.g. by destroy_process_group() before a new "
            "init_process_group()); a compiled graph keeps the group it was traced with: call "
            "torch._dynamo.reset() after re-initialising the process group",
            timed_out=False,
            waited=0.0,
            group_size=0,
        )
    return group


def layer_token(layer: Any) -> Tensor | None:
    """The token a compiled graph carries for ``layer`` (``None``: no layer, or one without syncbn state).

    Safe in traced code: an attribute read, guarded on its dtype and shape only.
    """
    if layer is None:
        return None
    state = layer.__dict__.get("_syncbn_state")
    if state is None:
        return None
    token: Tensor = state.token
    return token


@torch._dynamo.assume_constant_result
def tracing_a_checkpointed_region() -> bool:
    """Whether dynamo is tracing the body of ``torch.utils.checkpoint`` now (run while tracing only).

    torch 2.13's AOTAutograd cannot recompute an ordered effectful operator (the collective) in a
    checkpointed region; a layer then breaks the graph so that dynamo runs the region eagerly.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tracer: Any = InstructionTranslator.current_tx().output.current_tracer
    except Exception:  # not tracing, or a torch without these internals
        return False
    while tracer is not None:
        target = getattr(tracer, "source_target", None)
        if "checkpoint" in str(getattr(target, "__name__", target)):
            return True
        tracer = getattr(tracer, "parent", None)
    return False


# Registered directly (``torch.library.Library``), not through ``torch.library.custom_op``: a
# compiled graph calls ``torch.ops.syncbn.all_reduce_sum.default`` twice per layer per step, and
# custom_op's layers (its autograd wrapper, a redispatch, a dynamo-disabling wrapper and an
# aliasing check, all in Python) cost several times the framing they wrap
# (benchmarks/compile/op_call.py). Here: the implementation at CompositeExplicitAutograd (every
# device), the fake kernel for tracing (fake tensors, meta), and at Autograd one small kernel
# (_all_reduce_autograd) that records the adjoint where a gradient flows and otherwise goes
# straight to the implementation.
_lib = torch.library.Library("syncbn", "FRAGMENT")
_lib.define(
    "all_reduce_sum(Tensor tensor, int group, Tensor? layer, int phase, Tensor? source, int flags) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_all_reduce_op = torch.ops.syncbn.all_reduce_sum.default
_redispatch = _all_reduce_op.redispatch  # off the hot path: fake tensors, modes, the adjoint


def _all_reduce_impl(
    tensor: Tensor, group: int, layer: Tensor | None, phase: int, source: Tensor | None, flags: int
) -> Tensor:
    """The framed sum of ``tensor`` over group handle ``group`` (see the module docstring)."""
    global calls, backward_calls
    if phase == PHASE_FORWARD:
        calls += 1
    else:
        backward_calls += 1
    owner = None if layer is None else _checks.layer_for_token(int(layer))
    if owner is None and layer is not None:
        _warn_unbound()
    summed = _framed_sum(_live_group(group), tensor, owner, phase, source, flags)
    if summed.data_ptr() == tensor.data_ptr():  # never an alias of the input
        summed = summed.clone()
    return summed


_warned_unbound = False


def _warn_unbound() -> None:
    global _warned_unbound
    if not _warned_unbound:
        _warned_unbound = True
        warnings.warn(
            "syncbn: a compiled SyncBatchNorm's collective carries a layer token no live layer "
            "holds (a layer built from another's state and never placed into a model or run "
            "eagerly): its frames are anonymous and its first-use handshake is skipped; call "
            "syncbn.name_layers(model) or run one eager step first",
            stacklevel=2,
        )


def _framed_sum(
    sum_group: Any, tensor: Tensor, layer: Any, phase: int, source: Tensor | None, flags: int
) -> Tensor:
    """Handshake or debug check (with ``source``), the framed sum of a copy, the one-value check."""
    if source is not None:  # the Join policy of syncbn.engine._function decides whether checks run
        if phase == PHASE_FORWARD:
            _function.checks_before_forward(sum_group, layer, source)
        elif phase == PHASE_BACKWARD:
            call = _checks.state_of(layer).calls if layer is not None else 0
            _function.checks_before_backward(sum_group, layer, source, call)
    work = tensor.clone(memory_format=torch.contiguous_format)
    summed = _function._all_reduce(sum_group, work, layer, PHASE_NAMES.get(phase, "other"))
    if flags & CHECK_ONE_VALUE and float(summed.reshape(-1)[0]) == 1.0:
        raise _function._expected_more_than_one(source if source is not None else tensor, sum_group, layer)
    return summed


def _all_reduce_fake(
    tensor: Tensor, group: int, layer: Tensor | None, phase: int, source: Tensor | None, flags: int
) -> Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


class _Adjoint(torch.autograd.Function):
    """The operator's autograd formula: it is its own adjoint.

    d(sum over ranks of t_r)/d t_r is the identity: each rank's gradient is the sum of every
    rank's upstream gradient, one more collective (on every rank alike).
    """

    @staticmethod
    def forward(ctx: Any, keyset: Any, *args: Any) -> Tensor:  # type: ignore[override]
        """``args``: the operator's ``(tensor, group, layer, phase, source, flags)``."""
        ctx.group, ctx.layer = args[1], args[2]
        with _BelowAutograd():
            result: Tensor = _redispatch(keyset & _AFTER_AUTOGRAD, *args)
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        summed = _all_reduce_op(grad, ctx.group, ctx.layer, PHASE_BACKWARD, None, 0)
        return None, summed, None, None, None, None, None


# The device dispatch keys whose kernel is _all_reduce_impl (CompositeExplicitAutograd), and per
# dispatch keyset (its raw value) whether the Autograd kernel may call it directly.
_DEVICE_KEYS = frozenset(
    getattr(torch._C.DispatchKey, name)
    for name in ("CPU", "CUDA", "XPU", "MPS", "HPU", "MTIA", "PrivateUse1")
    if hasattr(torch._C.DispatchKey, name)
)
_direct: dict[int, bool] = {}


def _all_reduce_autograd(
    keyset: Any, tensor: Tensor, group: int, layer: Tensor | None, phase: int, source: Any, flags: int
) -> Tensor:
    """The Autograd kernel: record the adjoint where a gradient flows, else straight to the sum.

    On a plain device tensor (no fake tensor, dispatch mode or functionalization: the keyset
    below autograd leads to a device's kernel, which is :func:`_all_reduce_impl`) it calls the
    implementation itself, saving a redispatch through the dispatcher (~2 us); otherwise it
    redispatches.
    """
    if _grad_enabled() and (tensor.requires_grad or (source is not None and source.requires_grad)):
        out: Tensor = _Adjoint.apply(keyset, tensor, group, layer, phase, source, flags)
        return out
    raw = keyset.raw_repr()
    direct = _direct.get(raw)
    if direct is None:
        direct = _direct[raw] = (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _DEVICE_KEYS
    if direct:
        return _all_reduce_impl(tensor, group, layer, phase, source, flags)
    result: Tensor = _redispatch(keyset & _AFTER_AUTOGRAD, tensor, group, layer, phase, source, flags)
    return result


_lib.impl("all_reduce_sum", _all_reduce_impl, "CompositeExplicitAutograd")
_lib.impl("all_reduce_sum", _all_reduce_autograd, "Autograd", with_keyset=True)
_register_fake("syncbn::all_reduce_sum", _all_reduce_fake, lib=_lib)

# The collective is a side effect: keep every call, in program order, even where the output
# is empty (an empty local batch still takes part) or unused.
_register_effectful_op("syncbn::all_reduce_sum", EffectType.ORDERED)


def _snapshot_impl(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` that a compiled backward keeps rather than recomputes.

    AOTAutograd's partitioner may recompute cheap values in the backward graph
    from a forward input; where that input is a buffer the forward updates in
    place (a running statistic), the recomputation would read the updated value.
    An opaque operator is never recomputed, so its copy is saved instead. Registered
    directly, as the collective (no autograd formula: it copies buffers only).
    """
    return tensor.clone()


def _snapshot_fake(tensor: Tensor) -> Tensor:
    return torch.empty_like(tensor)


_lib.define("snapshot(Tensor tensor) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_lib.impl("snapshot", _snapshot_impl, "CompositeExplicitAutograd")
_register_fake("syncbn::snapshot", _snapshot_fake, lib=_lib)
snapshot = torch.ops.syncbn.snapshot.default


def all_reduce_sum(
    tensor: Tensor,
    group: Any = None,
    layer: Any = None,
    phase: str = "forward",
    *,
    source: Tensor | None = None,
    one_value_check: bool = False,
) -> Tensor:
    """Sum ``tensor`` over a syncbn group, framed with ``layer`` and ``phase``; eager and compiled.

    The seam for layers built on syncbn's collective (in-place activated batch
    norm, say): in eager mode the framed sum of
    :func:`syncbn.engine._function._all_reduce`; while ``torch.compile`` traces, the
    ordered effectful operator ``syncbn::all_reduce_sum`` (no graph break, no
    guard on ``layer``, never reordered or dropped). Without a group of more than
    one member the sum is ``tensor`` itself (copied).

    Args:
        tensor: the values to sum (float64, float32, float16 or bfloat16; any
            shape); left unchanged.
        group: a ``torch.distributed`` process group, ``None`` (the default
            group), a :class:`~syncbn.groups.ProcessGroupRef` or a resolved
            :class:`~syncbn.groups.SumGroup`: anything :func:`syncbn.groups.resolve`
            accepts. Compiled graphs resolve it once, while tracing.
        layer: the calling module (its name goes into the frame and into
            errors), or ``None``; a module needs a ``_syncbn_state``
            (:class:`syncbn._checks.LayerState`) made at construction.
        phase: ``"forward"``, ``"backward"`` or anything else (framed as
            another phase).
        source: the layer's input (forward) or upstream gradient (backward):
            runs the first-use handshake (ranks agree on channels and dtype) and
            debug mode's checks before the sum, as syncbn's own layer does.
        one_value_check: ``tensor``'s first value is this rank's count per
            channel: raise the "more than 1 value per channel" ``ValueError`` on
            every rank when the summed count is one (reads it on the host).

    Returns:
        A new tensor holding the sum over every member of the group.

    Shape:
        any; the result has ``tensor``'s shape (contiguous).

    Example::

        >>> packed = torch.stack([local_sum, local_sum_sq])         # (2, C)
        >>> total = syncbn.engine._ops.all_reduce_sum(packed, None, self, "forward")
    """
    code = _PHASES.get(phase, PHASE_OTHER)
    flags = CHECK_ONE_VALUE if one_value_check else 0
    if _is_compiling():
        handle = group_handle(group)
        if not handle:
            return tensor.clone()
        return _all_reduce_op(tensor, handle, layer_token(layer), code, source, flags)  # type: ignore[no-any-return]
    sum_group = groups.resolve(group)
    if sum_group is None:
        return tensor.clone()
    return _framed_sum(sum_group, tensor, layer, code, source, flags)
