"""How syncbn's layers appear in a ``torch.fx`` graph: one call of the layer, like torch's own.

Each layer's ``forward`` calls :func:`leaf_call` when given a ``Proxy`` (docs/internals/tools.md)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["call_forward", "leaf_call"]


def leaf_call(module: nn.Module, forward: Callable[..., Any], *args: Any) -> Any:
    """Record ``forward(module, *args)`` (the caller's class's ``forward``; trailing ``None`` arguments
    dropped) in the graph of ``args[0]``'s tracer and return the node's ``Proxy``; ``TypeError`` if the
    tracer is no ``torch.fx.Tracer`` (no module paths)."""
    tracer = args[0].tracer
    if not isinstance(tracer, torch.fx.Tracer):
        raise TypeError(
            f"syncbn: {type(module).__name__} can be traced by a torch.fx.Tracer, which records it "
            f"as a call of the layer (got a Proxy of a {type(tracer).__name__})"
        )
    path = tracer.path_of_module(module)
    if type(module).forward is forward:
        # The module's own forward: one node for the whole layer, as torch.nn's leaves get.
        return tracer.create_proxy("call_module", path, args, {})
    # Reached from a subclass's forward: record this part only, as a call on the layer.
    owner = next(cls for cls in type(module).__mro__ if cls.__dict__.get("forward") is forward)
    layer = tracer.create_proxy("get_attr", path, (), {})
    return tracer.create_proxy("call_function", call_forward, (layer, _name(owner), *args), {})


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def call_forward(layer: nn.Module, owner: str, *args: Any) -> Any:
    """Run on ``layer`` the ``forward`` of ``owner`` (``"module.QualifiedName"``, a class of its MRO):
    what a traced subclass's graph calls for the layer's part (importable, so the graph pickles)."""
    for cls in type(layer).__mro__:
        if _name(cls) == owner and "forward" in cls.__dict__:
            return cls.__dict__["forward"](layer, *args)
    raise TypeError(f"{type(layer).__name__} has no class {owner} with a forward in its MRO")
