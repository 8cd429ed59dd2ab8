"""What syncbn watches in the DDP wrappers of a process: a plain ``Join([ddp])`` (refused), DDP's
own bound (:func:`step_bound`). See docs/internals/groups.md#join-shadowing."""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from .. import _config
from ._own import timeout_s

__all__ = ["PlainJoinError", "StepBound", "UnboundedStepWarning", "check", "cover", "install", "step_bound"]

_wrappers: list[weakref.ref[nn.Module]] = []
# DDP wrapper -> the join configuration a JoinableSyncBatchNorm covered (a new Join makes a new one).
_covered: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
# DDP wrapper -> (the configuration it was looked at under, whether its model holds syncbn layers).
_holds: weakref.WeakKeyDictionary[nn.Module, tuple[Any, bool]] = weakref.WeakKeyDictionary()
# DDP wrapper -> the join hook syncbn handed its latest Join (alive while that Join is).
_hooks: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Watched]] = weakref.WeakKeyDictionary()
# DDP wrapper -> the handle of its first-step forward pre-hook (removed at that step).
_step_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_warned = False


class PlainJoinError(RuntimeError):
    """SyncBatchNorm layers trained under a ``Join`` that has no :class:`~syncbn.JoinableSyncBatchNorm`."""


class UnboundedStepWarning(UserWarning):
    """The bound the user set on syncbn's waits is outwaited by DDP's buffer broadcast.

    Raised as a warning only when ``SYNCBN_TIMEOUT`` or :func:`syncbn.set_timeout` chose the bound:
    DDP's defaults with syncbn's default bound print nothing (the limit is documented instead, on
    the Robustness page of the docs, section "What bounds a hang, end to end"). Not raised where
    the DDP model's first step is traced by ``torch.compile`` (:func:`step_bound` reports it).
    """


@dataclasses.dataclass(frozen=True)
class StepBound:
    """What bounds the first collective of a DDP step, against syncbn's bound (:func:`step_bound`).

    Attributes:
        bound: syncbn's bound on its own waits in seconds, ``None`` for none (:func:`syncbn.get_timeout`).
        bound_source: who chose it: ``"set_timeout"``, ``"SYNCBN_TIMEOUT"`` or ``"default"``.
        group_timeout: the process group's own timeout, in seconds: what bounds DDP's collectives.
        broadcast_buffers: whether DDP broadcasts the module buffers at each forward (DDP's
            default; ``forward_sync_buffers`` from torch 2.13): the first collective of a step.
        holds_syncbn: whether the model holds syncbn layers.
    """

    bound: float | None
    bound_source: str
    group_timeout: float
    broadcast_buffers: bool
    holds_syncbn: bool

    @property
    def outwaited(self) -> bool:
        """Whether DDP's buffer broadcast can wait longer than syncbn's bound (a frozen rank found later)."""
        return (
            self.broadcast_buffers
            and self.holds_syncbn
            and self.bound is not None
            and self.group_timeout > self.bound
        )

    @property
    def user_bound_outwaited(self) -> bool:
        """:attr:`outwaited` for a bound the user chose: the one case syncbn warns about."""
        return self.outwaited and self.bound_source != "default"

    def message(self) -> str:
        """The finding and its two remedies, in words (names no file)."""
        chosen = {"set_timeout": "syncbn.set_timeout", "SYNCBN_TIMEOUT": "SYNCBN_TIMEOUT"}
        who = chosen.get(self.bound_source, "syncbn's default bound")
        bound = "no bound" if self.bound is None else f"{self.bound:g} s"
        return (
            f"syncbn: {who} ({bound}) bounds the SyncBatchNorm collectives, but the first "
            "collective of each DistributedDataParallel step is DDP's own buffer broadcast, bounded by "
            f"the process group's timeout ({self.group_timeout:g} s): a rank frozen between steps is "
            "found only then. Pass timeout=datetime.timedelta(seconds=...) to init_process_group, or "
            "use DistributedDataParallel(..., broadcast_buffers=False) (forward_sync_buffers=False "
            "from torch 2.13) when only batch-norm buffers need it (syncbn keeps them equal on every "
            "rank). See the Robustness page of the syncbn documentation, section 'What bounds a hang, "
            "end to end'."
        )


def step_bound(ddp: nn.Module) -> StepBound:
    """What bounds the first collective of each step of ``ddp``, against syncbn's bound.

    Reads the settings only (no collective). ``syncbn doctor`` reports it; syncbn itself warns
    (:class:`UnboundedStepWarning`) only when :attr:`StepBound.user_bound_outwaited`.

    Args:
        ddp: a ``torch.nn.parallel.DistributedDataParallel`` model (any module: its
            ``broadcast_buffers`` and ``process_group`` attributes are read where it has them;
            without them, DDP's defaults: buffers broadcast over the default group).

    Returns:
        A :class:`StepBound`.

    Example::

        >>> finding = syncbn.groups.step_bound(ddp)
        >>> if finding.outwaited:
        ...     print(finding.message())
    """
    return StepBound(
        bound=_config.get_timeout(),
        bound_source=_config.timeout_source(),
        group_timeout=timeout_s(ddp.__dict__.get("process_group")),
        broadcast_buffers=bool(getattr(ddp, "broadcast_buffers", True)),
        holds_syncbn=any("_syncbn_state" in m.__dict__ for m in ddp.modules()),
    )


class _Watched(JoinHook):
    """DDP's join hook, forwarded; ``done`` once its ``Join`` has run its post-hooks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = False

    def main_hook(self) -> None:
        self.inner.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            self.inner.post_hook(is_last_joiner)
        finally:
            self.done = True


class _JoinHookOf:
    """``join_hook`` of one DDP model (an instance attribute, holding it weakly): DDP's hook, watched."""

    def __init__(self, ddp: nn.Module) -> None:
        self._ddp = weakref.ref(ddp)

    def __call__(self, **kwargs: Any) -> JoinHook:
        ddp = self._ddp()
        assert ddp is not None  # called through the model that holds it
        hook = _Watched(type(ddp).join_hook(ddp, **kwargs))  # type: ignore[attr-defined]
        _hooks[ddp] = weakref.ref(hook)
        return hook

    def __reduce__(self) -> tuple[Any, ...]:
        return (_JoinHookOf, (self._ddp(),))


def _join_live(ddp: nn.Module) -> bool:
    """Whether the latest ``Join`` over ``ddp`` is still going (unknown: assumed so)."""
    ref = _hooks.get(ddp)
    if ref is None:
        return True
    hook = ref()
    return hook is not None and not hook.done


def _record(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """The module registration hook: remember each ``DistributedDataParallel`` as it takes its module."""
    if name == "module" and child is not None and isinstance(parent, nn.parallel.DistributedDataParallel):
        _wrappers[:] = [r for r in _wrappers if r() is not None and r() is not parent]
        _wrappers.append(weakref.ref(parent))
        if "join_hook" not in parent.__dict__:
            parent.__dict__["join_hook"] = _JoinHookOf(parent)  # hands Join a _Watched hook
        if not _warned and parent not in _step_hooks:
            _step_hooks[parent] = parent.register_forward_pre_hook(_first_step)


# The user's ``ddp(x)``, above _first_step, _call_impl's inner, _call_impl and _wrapped_call_impl.
_USER_STACKLEVEL = 5


def _first_step(ddp: nn.Module, args: Any) -> None:
    """DDP's pre-hook, gone after its first step: warn once if its broadcast outwaits the user's bound."""
    global _warned
    if torch.compiler.is_compiling():
        # Traced (compile(DDP(m))): nothing here, not even the removal (dynamo cannot hold a hook
        # handle, and a graph break in DDP's pre-hook sent the whole DDP frame back to eager); an
        # eager step removes it. No process-group read either: the doctor states the finding.
        return
    handle = _step_hooks.pop(ddp, None)
    if handle is not None:
        handle.remove()
    if _warned or _config.timeout_source() == "default" or not getattr(ddp, "broadcast_buffers", False):
        return  # the common case: quiet
    finding = step_bound(ddp)
    if finding.user_bound_outwaited:
        _warned = True
        warnings.warn(finding.message(), UnboundedStepWarning, stacklevel=_USER_STACKLEVEL)


@functools.cache  # once per process
def install() -> None:
    """Start recording DDP wrappers."""
    nn.modules.module.register_module_module_registration_hook(_record)


def cover(model: nn.Module) -> None:
    """Mark the join configuration of ``model``'s DDP wrapper (or of ``model``) as shadowed by syncbn."""
    for ref in _wrappers:
        ddp = ref()
        if ddp is not None and (ddp is model or ddp.__dict__.get("_modules", {}).get("module") is model):
            config = ddp.__dict__.get("_join_config")
            if config is not None:
                _covered[ddp] = config


def _has_layers(ddp: nn.Module, config: Any) -> bool:
    seen = _holds.get(ddp)
    if seen is not None and seen[0] is config:
        return seen[1]
    found = any("_syncbn_state" in m.__dict__ for m in ddp.modules())
    _holds[ddp] = (config, found)
    return found


def check() -> None:
    """Raise :class:`PlainJoinError` when a DDP model of this process is in an unshadowed ``Join``."""
    for ref in _wrappers:
        ddp = ref()
        if ddp is None:
            continue
        config = ddp.__dict__.get("_join_config")
        if config is None or not config.enable or _covered.get(ddp) is config:
            continue
        if getattr(config, "throw_on_early_termination", False):
            continue  # no rank shadows: DDP's own errors, on every rank, as with nn.BatchNorm
        if not _join_live(ddp) or not _has_layers(ddp, config):
            continue
        raise PlainJoinError(
            "syncbn: a DistributedDataParallel model with SyncBatchNorm layers is training inside "
            "torch.distributed.algorithms.join.Join without syncbn.JoinableSyncBatchNorm. DDP's join "
            "hook shadows only DDP's own collectives: a rank that runs out of inputs would leave the "
            "others waiting in a SyncBatchNorm collective. Put a syncbn.JoinableSyncBatchNorm first in "
            "the list, on every rank: `with Join([syncbn.JoinableSyncBatchNorm(ddp), ddp]): ...`. "
            "Or use torch's pattern, Join([ddp], throw_on_early_termination=True), where every rank "
            "raises DDP's error once one runs out. Raised on every rank at the first SyncBatchNorm "
            "collective inside the Join; nothing was sent and no state changed."
        )
