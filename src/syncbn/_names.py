"""Where a module sits in its model, for error messages: parent links recorded at registration.

A global module registration hook keeps weak ``(parent, attribute)`` links per child;
:func:`qualified_name` walks them up. See docs/internals/layers.md.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

from torch import nn

__all__ = ["install", "qualified_name"]

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)
_MAX_LINKS = 8  # parents remembered per child (a module may be placed in several containers)

_links: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref[nn.Module], str]]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()
_on_wrap: Callable[[nn.Module], object] | None = None


def _record(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """The registration hook: remember that ``parent.<name>`` is ``child``."""
    # ``parent.__dict__``, not getattr: torch.compile's OptimizedModule runs this hook before its own
    # attributes exist (its __getattr__ would recurse). Its ``_orig_mod`` link is not a place in the model.
    if child is None or name == "_orig_mod" or parent.__dict__.get("_is_replica", False):
        return
    with _lock:
        links = _links.setdefault(child, [])
        links[:] = [(r, k) for r, k in links if r() is not None and (r() is not parent or k != name)]
        links.append((weakref.ref(parent), name))
        del links[:-_MAX_LINKS]
    if _on_wrap is not None and name == "module" and isinstance(parent, _WRAPPERS):
        _on_wrap(child)


def install(on_wrap: Callable[[nn.Module], object]) -> None:
    """Start recording parent links (once per process).

    ``on_wrap(model)`` runs when a model is placed into a DDP or DataParallel wrapper.
    """
    global _on_wrap
    with _lock:
        if _on_wrap is not None:
            return
        _on_wrap = on_wrap
    nn.modules.module.register_module_module_registration_hook(_record)


def _holder(child: nn.Module) -> tuple[nn.Module, str] | None:
    """The first-recorded parent that still holds ``child``, and the attribute it holds it under."""
    with _lock:
        links = list(_links.get(child, ()))
    for ref, key in links:
        parent = ref()
        if parent is not None and parent._modules.get(key) is child:
            return parent, key
    return None


def qualified_name(module: nn.Module) -> str | None:
    """``module``'s dotted path (``'layer2.0.bn1'``) from the outermost recorded model, or ``None``.

    Stops at a DDP/DataParallel wrapper, so names read as in the bare model.
    """
    parts: list[str] = []
    current = module
    seen = {id(module)}
    while (found := _holder(current)) is not None:
        parent, key = found
        if (key == "module" and isinstance(parent, _WRAPPERS)) or id(parent) in seen:  # seen: a cycle
            break
        seen.add(id(parent))
        parts.append(key)
        current = parent
    return ".".join(reversed(parts)) if parts else None
