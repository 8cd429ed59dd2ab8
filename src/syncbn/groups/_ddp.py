"""What syncbn watches in the DDP wrappers of a process: a plain ``Join([ddp])``, DDP's own bound.

A ``Join([ddp])`` without :class:`syncbn.JoinableSyncBatchNorm` is refused on every rank at once
(:class:`PlainJoinError`); DDP's buffer broadcast, bounded only by the process group's timeout,
is warned about once (:class:`UnboundedStepWarning`). See docs/internals/groups.md#join-shadowing.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from torch import nn
from torch.distributed.algorithms.join import JoinHook

from .. import _config
from ._errors import _pg_timeout

__all__ = ["PlainJoinError", "UnboundedStepWarning", "check", "cover", "install"]

_wrappers: list[weakref.ref[nn.Module]] = []
# DDP wrapper -> the join configuration a JoinableSyncBatchNorm covered (a new Join makes a new one).
_covered: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
# DDP wrapper -> (the configuration it was looked at under, whether its model holds syncbn layers).
_holds: weakref.WeakKeyDictionary[nn.Module, tuple[Any, bool]] = weakref.WeakKeyDictionary()
# DDP wrapper -> the join hook syncbn handed its latest Join (alive while that Join is).
_hooks: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Watched]] = weakref.WeakKeyDictionary()
_examined: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # looked at for the buffer broadcast
_warned = False


class PlainJoinError(RuntimeError):
    """SyncBatchNorm layers trained under a ``Join`` that has no :class:`~syncbn.JoinableSyncBatchNorm`."""


class UnboundedStepWarning(UserWarning):
    """DDP's buffer broadcast, the first collective of a step, waits longer than syncbn's bound."""


class _Watched(JoinHook):
    """DDP's join hook, forwarded; tells syncbn when its ``Join`` has run its post-hooks."""

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
    """``join_hook`` of one DDP model (an instance attribute): DDP's hook, handed over watched.

    Holds the model weakly; a pickled or deep-copied model gets one of its own (``__reduce__``).
    """

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
    """The registration hook: remember each ``DistributedDataParallel`` as it takes its module."""
    if name == "module" and child is not None and isinstance(parent, nn.parallel.DistributedDataParallel):
        _wrappers[:] = [r for r in _wrappers if r() is not None and r() is not parent]
        _wrappers.append(weakref.ref(parent))
        if "join_hook" not in parent.__dict__:
            parent.__dict__["join_hook"] = _JoinHookOf(parent)  # hands Join a _Watched hook


@functools.cache  # once per process
def install() -> None:
    """Start recording DDP wrappers (syncbn does it when it is imported)."""
    nn.modules.module.register_module_module_registration_hook(_record)


def cover(model: nn.Module) -> None:
    """Mark the join configuration of ``model``'s DDP wrapper (or ``model`` itself) as shadowed by syncbn."""
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


def _look_at_buffers(ddp: nn.Module, config: Any) -> None:
    """Warn once per process when ``ddp``'s buffer broadcast is bounded far above syncbn's bound."""
    global _warned
    _examined.add(ddp)
    bound = _config.get_timeout()
    # DDP's forward buffer sync: broadcast_buffers (from torch 2.13 a property: forward_sync_buffers)
    if bound is None or not getattr(ddp, "broadcast_buffers", False) or not _has_layers(ddp, config):
        return
    group_timeout = _pg_timeout(ddp.__dict__.get("process_group"))
    if group_timeout <= 2 * bound:
        return
    _warned = True
    warnings.warn(
        f"syncbn: SYNCBN_TIMEOUT ({bound:g} s) bounds the SyncBatchNorm collectives, but the first "
        "collective of each DistributedDataParallel step is DDP's own buffer broadcast, bounded by "
        f"the process group's timeout ({group_timeout:g} s): a rank frozen between steps is found "
        "only then. Pass timeout=datetime.timedelta(seconds=...) to init_process_group, or use "
        "DistributedDataParallel(..., broadcast_buffers=False) (forward_sync_buffers=False from torch "
        "2.13) when only batch-norm buffers need it (syncbn keeps them equal on every rank). See "
        "docs/robustness.md, 'What bounds a hang'.",
        UnboundedStepWarning,
        stacklevel=2,
    )


def check() -> None:
    """Raise :class:`PlainJoinError` when a DDP model of this process is in an unshadowed ``Join``."""
    for ref in _wrappers:
        ddp = ref()
        if ddp is None:
            continue
        config = ddp.__dict__.get("_join_config")
        if not _warned and ddp not in _examined:
            _look_at_buffers(ddp, config)
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
