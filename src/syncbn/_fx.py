"""How syncbn's layers appear in a ``torch.fx`` graph: as one call of the layer, like torch's own.

``torch.fx.symbolic_trace`` records a call to a module of ``torch.nn`` as one
``call_module`` node (a leaf) and traces into every other module's ``forward``.
A synchronised layer's forward checks its input and runs a collective, which a
``Proxy`` cannot do, so each layer's ``forward`` first asks :func:`leaf_call`:
given a ``Proxy`` it records the call in the tracer's graph and returns the
node's proxy, and the layer is a leaf exactly as ``nn.BatchNorm2d`` is. The
traced ``GraphModule`` then calls the layer itself, which synchronises, in
training and eval alike (the mode is read when the graph runs, not when it is
traced). Node names are those a ``torch.nn`` layer gets, so tools that name
nodes by module path (torchvision's ``create_feature_extractor``) see the same
names as for the unconverted model.

A subclass whose own ``forward`` calls the layer's ``forward`` (and does more
around it) is traced through; the layer's part is then recorded as a call of
that ``forward`` on the layer (a ``get_attr`` node and a ``call_function``
node of :func:`call_forward`), so the subclass's extra work stays in the graph
and runs once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["call_forward", "leaf_call"]


def leaf_call(module: nn.Module, forward: Callable[..., Any], *args: Any) -> Any:
    """Record ``forward(module, *args)`` in the graph of the tracer of ``args[0]``, a ``Proxy``.

    Args:
        module: the layer being called.
        forward: the ``forward`` function that is running (the caller's class's).
        *args: the call's arguments, the first a ``torch.fx.Proxy`` (``None`` ones
            at the end dropped by the caller).

    Returns:
        The ``Proxy`` of the recorded node.

    Raises:
        TypeError: the proxy's tracer is no ``torch.fx.Tracer`` (it knows no module paths).
    """
    tracer = args[0].tracer
    if not isinstance(tracer, torch.fx.Tracer):  # no module paths to record the call by
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


_FORWARDS: dict[tuple[type, str], Callable[..., Any]] = {}


def call_forward(layer: nn.Module, owner: str, *args: Any) -> Any:
    """Run the ``forward`` defined by ``owner``, a class of ``layer``'s MRO, on ``layer``.

    What a traced subclass's graph calls for the layer's part (an importable
    function, so the ``GraphModule`` pickles).

    Args:
        layer: the layer.
        owner: ``"module.QualifiedName"`` of the class whose ``forward`` to run.
        *args: the forward's arguments.

    Returns:
        What that ``forward`` returns.
    """
    key = (type(layer), owner)
    forward = _FORWARDS.get(key)
    if forward is None:
        found = [cls for cls in type(layer).__mro__ if _name(cls) == owner and "forward" in cls.__dict__]
        if not found:
            raise TypeError(f"{type(layer).__name__} has no class {owner} with a forward in its MRO")
        forward = _FORWARDS[key] = found[0].__dict__["forward"]
    return forward(layer, *args)
