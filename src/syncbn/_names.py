"""Where a module sits in its model, for error messages: parent links recorded at registration.

An error names a layer by its qualified name (``'layer2.0.bn1'``). A layer does
not know its parents, so syncbn records them as the model is built: torch calls
a global module registration hook
(``torch.nn.modules.module.register_module_module_registration_hook``) every
time a module is assigned as another's child, and :func:`install` adds one that
keeps a weak ``(parent, attribute)`` link per child. :func:`qualified_name`
walks those links up to the outermost model, checking each against the
parent's current children (a link whose parent is gone, or which no longer
holds the child, is skipped), and stops at a ``DistributedDataParallel`` or
``DataParallel`` wrapper so that names read as in the bare model.

The hook is installed when the first syncbn layer is built, so every parent a
layer is later placed into is seen. Replicas made by ``nn.DataParallel`` are
not recorded (their parents are marked ``_is_replica``). When a model is put
into a ``DistributedDataParallel``/``DataParallel`` wrapper, the ``on_wrap``
callback given to :func:`install` runs with the model, which lets the caller
name its layers there (a model loaded whole from disk, or built before the
first syncbn layer existed, has no recorded links).
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
_installed = False
_on_wrap: Callable[[nn.Module], None] | None = None


def _record(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """The registration hook: remember that ``parent.<name>`` is ``child``."""
    # ``parent.__dict__``, not getattr: wrappers such as torch.compile's OptimizedModule run this hook
    # before their own attributes exist, and their __getattr__ would recurse. A compiled model's
    # ``_orig_mod`` link is not a place in the model: names stay those of the uncompiled model.
    if child is None or name == "_orig_mod" or parent.__dict__.get("_is_replica", False):
        return None
    with _lock:
        links = _links.get(child)
        if links is None:
            links = _links[child] = []
        # Drop links to parents that are gone, and an older copy of this very link.
        links[:] = [(r, k) for r, k in links if r() is not None and (r() is not parent or k != name)]
        links.append((weakref.ref(parent), name))
        del links[:-_MAX_LINKS]
    if _on_wrap is not None and name == "module" and isinstance(parent, _WRAPPERS):
        _on_wrap(child)
    return None


def install(on_wrap: Callable[[nn.Module], None]) -> None:
    """Start recording parent links (once per process; later calls do nothing).

    Args:
        on_wrap: called with a model when it is placed into a
            ``DistributedDataParallel`` or ``DataParallel`` wrapper.
    """
    global _installed, _on_wrap
    with _lock:
        if _installed:
            return
        _installed = True
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
    """``module``'s dotted path from the outermost recorded model (wrappers looked through), if any.

    Args:
        module: the layer.

    Returns:
        The name, e.g. ``'layer2.0.bn1'``, or ``None`` when no parent is recorded.
    """
    parts: list[str] = []
    current = module
    seen = {id(module)}
    while True:
        found = _holder(current)
        if found is None:
            break
        parent, key = found
        if key == "module" and isinstance(parent, _WRAPPERS):
            break
        if id(parent) in seen:  # a module that contains itself: stop
            break
        seen.add(id(parent))
        parts.append(key)
        current = parent
    return ".".join(reversed(parts)) if parts else None
