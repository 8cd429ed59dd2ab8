"""A ``Join([ddp])`` without :class:`syncbn.JoinableSyncBatchNorm`, refused on every rank at once.

Under ``torch.distributed.algorithms.join.Join``, DDP's join hook shadows DDP's own collectives
for a rank that ran out of inputs; nothing shadows SyncBatchNorm's, so the ranks still training
would wait for it in their next SyncBatchNorm collective (before syncbn had groups of its own,
DDP's shadow all_reduce even met a syncbn frame and gloo aborted the process). A joined rank
cannot learn of syncbn's collectives from DDP's hook, so the plain ``Join([ddp])`` cannot be
made exact; it is refused instead, deterministically: ``Join(...)`` sets an enabled
``_join_config`` on every joinable of its list, on every rank, before the first forward inside
it. Every framed call of a :class:`~syncbn.groups.ProcessGroupSum` first looks at the
``DistributedDataParallel`` wrappers of this process that hold syncbn layers (recorded as they
are built, through torch's module registration hook); one in join mode whose configuration no
:class:`~syncbn.JoinableSyncBatchNorm` has covered raises :class:`PlainJoinError` there, on
every rank alike, before anything is sent and before any state changed.

A ``Join`` leaves its configuration on the DDP model after the context ends; a model that went
through a plain ``Join([ddp])`` (an evaluation loop, say) is still refused when it trains
later: construct ``Join([ddp], enable=False)`` once to switch join mode off, or train under
``Join([syncbn.JoinableSyncBatchNorm(ddp), ddp])``.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["PlainJoinError", "check", "cover", "install"]

_installed = False
_wrappers: list[weakref.ref[nn.Module]] = []
# DDP wrapper -> the join configuration a JoinableSyncBatchNorm covered (a new Join makes a new one).
_covered: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
# DDP wrapper -> (the configuration it was looked at under, whether its model holds syncbn layers).
_holds: weakref.WeakKeyDictionary[nn.Module, tuple[Any, bool]] = weakref.WeakKeyDictionary()


class PlainJoinError(RuntimeError):
    """SyncBatchNorm layers trained under a ``Join`` that has no :class:`~syncbn.JoinableSyncBatchNorm`."""


def _record(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """The registration hook: remember each ``DistributedDataParallel`` as it takes its module."""
    if name == "module" and child is not None and isinstance(parent, nn.parallel.DistributedDataParallel):
        _wrappers[:] = [r for r in _wrappers if r() is not None and r() is not parent]
        _wrappers.append(weakref.ref(parent))
    return None


def install() -> None:
    """Start recording DDP wrappers (once per process; syncbn does it when it is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    register = getattr(nn.modules.module, "register_module_module_registration_hook", None)
    if register is not None:  # torch >= 2.0
        register(_record)


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


def check() -> None:
    """Raise :class:`PlainJoinError` when a DDP model of this process is in an unshadowed ``Join``."""
    for ref in _wrappers:
        ddp = ref()
        if ddp is None:
            continue
        config = ddp.__dict__.get("_join_config")
        if config is None or not config.enable or _covered.get(ddp) is config:
            continue
        if not _has_layers(ddp, config):
            continue
        raise PlainJoinError(
            "syncbn: a DistributedDataParallel model with SyncBatchNorm layers is training inside "
            "torch.distributed.algorithms.join.Join without syncbn.JoinableSyncBatchNorm. DDP's join "
            "hook shadows only DDP's own collectives: a rank that runs out of inputs would leave the "
            "others waiting in a SyncBatchNorm collective. Put a syncbn.JoinableSyncBatchNorm first in "
            "the list, on every rank: `with Join([syncbn.JoinableSyncBatchNorm(ddp), ddp]): ...`. "
            "Raised on every rank at the first SyncBatchNorm collective inside the Join; nothing was "
            "sent and no state changed. (A Join leaves join mode on the DDP model after the context: "
            "for a model that went through a plain Join before, construct Join([ddp], enable=False) "
            "once to switch it off.)"
        )
