"""The collective as one ordered, effectful ``torch.library`` operator, for ``torch.compile``. Schema and
registration: docs/internals/engine.md; :func:`all_reduce_sum`: for other layers' traced code."""

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

CHECK_ONE_VALUE = 1  # flags bit: raise the one-value error when the summed count (element 0) is 1

# handle -> a weak reference to its SumGroup (0: no group; handles are never reused).
_groups: dict[int, Callable[[], Any]] = {}
_group_ids: dict[int, int] = {}  # id(SumGroup) -> handle, while the group lives
_handles = itertools.count(1)
# How many times the operator ran (diagnostics, tests): forward-phase calls and the others.
calls = 0
backward_calls = 0


@_rules.constant_while_tracing
def group_handle(process_group: Any) -> int:
    """The integer standing for the group ``process_group`` resolves to now (0: none, run locally)."""
    group = groups.resolve(process_group)
    group = getattr(group, "base", group)  # a Join's wrapper: its group (wrapped again at run time)
    if group is None:
        return 0
    handle = _group_ids.get(id(group))
    if handle is None or group_of(handle) is not group:
        _prune()
        handle = next(_handles)
        try:
            ref: Callable[[], Any] = weakref.ref(group)
        except TypeError:  # a SumGroup that cannot be weakly referenced: held for good
            ref = lambda: group  # noqa: E731
        _groups[handle] = ref
        _group_ids[id(group)] = handle
    return handle


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
    """The token a compiled graph carries for ``layer`` (or ``None``): an attribute read, safe traced."""
    state = None if layer is None else layer.__dict__.get("_syncbn_state")
    token: Tensor | None = None if state is None else state.token
    return token


@_rules.constant_while_tracing
def tracing_a_checkpointed_region() -> bool:
    """Whether dynamo traces a ``torch.utils.checkpoint`` body (torch 2.13 can't recompute the collective)."""
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


# Registered directly, not through custom_op, whose Python layers cost more (docs/internals/engine.md).
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
    """The framed sum of ``tensor`` over group handle ``group``; never an alias of the input."""
    global calls, backward_calls
    if phase == PHASE_FORWARD:
        calls += 1
    else:
        backward_calls += 1
    owner = None if layer is None else _checks.layer_for_token(int(layer))
    if owner is None and layer is not None:
        _warn_unbound()
    summed = _framed_sum(groups.joined(_live_group(group)), tensor, owner, phase, source, flags)
    return summed.clone() if summed.data_ptr() == tensor.data_ptr() else summed


@functools.cache  # warned once
def _warn_unbound() -> None:
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
    if source is not None:  # (a Join's wrapper is checked by its joinable, not here)
        if phase == PHASE_FORWARD:
            _checks.before_forward(sum_group, layer, source)
        elif phase == PHASE_BACKWARD:
            call = _checks.state_of(layer).calls if layer is not None else 0
            _checks.before_backward(sum_group, layer, source, call)
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
    """The operator's autograd formula: its own adjoint (one more collective, on every rank alike)."""

    @staticmethod
    def forward(ctx: Any, keyset: Any, *args: Any) -> Tensor:  # type: ignore[override]
        """``args``: the operator's ``(tensor, group, layer, phase, source, flags)``."""
        ctx.group, ctx.layer = args[1], args[2]
        with _BelowAutograd():
            return _redispatch(keyset & _AFTER_AUTOGRAD, *args)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        summed = _all_reduce_op(grad, ctx.group, ctx.layer, PHASE_BACKWARD, None, 0)
        return None, summed, None, None, None, None, None


# The device keys whose kernel is _all_reduce_impl, and per raw keyset whether to call it directly.
_DEVICE_KEYS = frozenset(
    getattr(torch._C.DispatchKey, name)
    for name in ("CPU", "CUDA", "XPU", "MPS", "HPU", "MTIA", "PrivateUse1")
    if hasattr(torch._C.DispatchKey, name)
)
_direct: dict[int, bool] = {}


def _all_reduce_autograd(
    keyset: Any, tensor: Tensor, group: int, layer: Tensor | None, phase: int, source: Any, flags: int
) -> Tensor:
    """The Autograd kernel: the adjoint where a gradient flows, else the sum (a plain device tensor's
    directly, saving a redispatch)."""
    if _grad_enabled() and (tensor.requires_grad or (source is not None and source.requires_grad)):
        return _Adjoint.apply(keyset, tensor, group, layer, phase, source, flags)
    raw = keyset.raw_repr()
    direct = _direct.get(raw)
    if direct is None:
        direct = _direct[raw] = (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _DEVICE_KEYS
    if direct:
        return _all_reduce_impl(tensor, group, layer, phase, source, flags)
    return _redispatch(keyset & _AFTER_AUTOGRAD, tensor, group, layer, phase, source, flags)


_lib.impl("all_reduce_sum", _all_reduce_impl, "CompositeExplicitAutograd")
_lib.impl("all_reduce_sum", _all_reduce_autograd, "Autograd", with_keyset=True)
_register_fake("syncbn::all_reduce_sum", _all_reduce_fake, lib=_lib)

# Keep every call, in program order, even where the output is empty or unused.
_register_effectful_op("syncbn::all_reduce_sum", EffectType.ORDERED)


# A copy a compiled backward keeps rather than recomputes from a buffer updated in place since.
_lib.define("snapshot(Tensor tensor) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_lib.impl("snapshot", lambda tensor: tensor.clone(), "CompositeExplicitAutograd")
_register_fake("syncbn::snapshot", lambda tensor: torch.empty_like(tensor), lib=_lib)
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

    Eager: the framed sum of :func:`syncbn.engine._function._all_reduce`; while compiling, the
    operator ``syncbn::all_reduce_sum`` (no graph break, no guard on ``layer``). Without a group
    of more than one member the result is a copy of ``tensor``.

    Args:
        tensor: the values to sum (any shape, a float dtype); left unchanged.
        group: anything :func:`syncbn.groups.resolve` accepts (compiled graphs resolve it once).
        layer: the calling module (with a ``_syncbn_state``, named in the frame and errors) or ``None``.
        phase: ``"forward"``, ``"backward"`` or anything else (framed as another phase).
        source: the layer's input or upstream gradient: runs the handshake and debug checks first.
        one_value_check: ``tensor``'s first value is the count: raise the one-value ``ValueError``
            on every rank when the summed count is one.

    Returns:
        A new contiguous tensor of ``tensor``'s shape: the sum over the group.

    Example::

        >>> total = syncbn.engine._ops.all_reduce_sum(torch.stack([s, q]), None, self, "forward")
    """
    code = _function._PHASE_CODES.get(phase, PHASE_OTHER)
    flags = CHECK_ONE_VALUE if one_value_check else 0
    if _rules.is_compiling():
        handle = group_handle(group)
        if not handle:
            return tensor.clone()
        return _all_reduce_op(tensor, handle, layer_token(layer), code, source, flags)
    sum_group = groups.resolve(group)
    if sum_group is None:
        return tensor.clone()
    return _framed_sum(sum_group, tensor, layer, code, source, flags)
