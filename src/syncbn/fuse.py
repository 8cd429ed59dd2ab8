"""Fuse a model's BatchNorm + LeakyReLU/ELU pairs into :class:`syncbn.InPlaceSyncBatchNorm` layers."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

from ._checks import name_layers
from ._layer import check_module, like
from .activated import InPlaceSyncBatchNorm, InPlaceSyncBatchNorm2d, activation_of
from .modules import SyncBatchNorm

__all__ = ["fuse_batchnorm_activation"]

_Pair = tuple[str, nn.Sequential, str, str]  # (container's name, container, bn key, activation key)

_FUSABLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, SyncBatchNorm, nn.SyncBatchNorm)


def _fusable(bn: nn.Module) -> bool:
    if not isinstance(bn, _FUSABLE):
        return False
    if isinstance(bn, SyncBatchNorm) and type(bn)._family_call is not SyncBatchNorm._family_call:
        return False  # a family of its own (renorm's r and d): its training is not batch norm's
    if getattr(bn, "freeze", False):
        return False  # normalises with its running statistics: the in-place layers have no freeze
    # A subclass with a forward of its own does more than batch norm: leave it.
    return any(type(bn).forward is cls.forward for cls in _FUSABLE)


def _pairs(module: nn.Module) -> list[_Pair]:
    """``(name, seq, bn key, activation key)`` of every fusable pair of neighbours."""
    found = []
    for name, seq in module.named_modules():
        if isinstance(seq, nn.Sequential):
            items = list(seq._modules.items())
            for (key, bn), (act_key, act) in zip(items, items[1:]):
                if bn is not None and act is not None and _fusable(bn) and activation_of(act) is not None:
                    found.append((name, seq, key, act_key))
    return found


def fuse_batchnorm_activation(
    module: nn.Module, process_group: Any = None, *, strict: bool = True
) -> nn.Module:
    """Replace ``BatchNorm`` -> ``LeakyReLU``/``ELU`` neighbours of ``nn.Sequential`` containers, in place.

    Each pair ``(bn, act)`` at positions ``i, i+1`` becomes ``(InPlaceSyncBatchNorm, nn.Identity())``,
    with the BatchNorm's ``state_dict`` keys, ``Parameter`` objects and buffers (an optimizer built
    before keeps working); ``nn.BatchNorm2d`` becomes :class:`~syncbn.InPlaceSyncBatchNorm2d`, the
    others the generic :class:`~syncbn.InPlaceSyncBatchNorm`. Only ``nn.LeakyReLU`` with a positive
    slope and ``nn.ELU`` qualify (``ReLU`` is not invertible). Renorm (``SyncBatchRenorm*``) and frozen
    (``freeze=True``) layers are left as they are: their training is not batch norm's.

    The in-place scale is :math:`|w| + \\epsilon`, so the fused weight is :math:`w - \\epsilon`:
    exact when :math:`w \\ge \\epsilon`. Channels below cannot be represented (``strict``: refused;
    else clamped to 0, scale :math:`\\epsilon`, which changes the model there).

    A BatchNorm held in several places is fused once: the same new layer object at each of its
    pairs. One that is also used elsewhere (outside a pair, or in pairs with different activations)
    is left unfused, with a warning: its fused weight would change those other uses.

    Args:
        module: the model.
        process_group: the fused layers' group (``None``: the default group, or a ``SyncBatchNorm``'s own).
        strict: refuse weights below ``eps`` (``True``) or clamp them to 0 (``False``, with a warning).

    Returns:
        ``module``, with the pairs fused.

    Raises:
        ValueError: ``strict`` and a BatchNorm weight below ``eps``; nothing is changed.

    Example::

        >>> model = torch.nn.Sequential(
        ...     torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.LeakyReLU(0.1)
        ... )
        >>> model = syncbn.fuse_batchnorm_activation(model)
        >>> [type(m).__name__ for m in model]
        ['Conv2d', 'InPlaceSyncBatchNorm2d', 'Identity']
    """
    check_module(module, "fuse_batchnorm_activation")
    # Each BatchNorm once (one may sit in several pairs): fused only where every place that holds
    # it is a pair with the same activation, since its fused weight w - eps serves all of them.
    by_bn: dict[int, list[_Pair]] = {}
    for pair in _pairs(module):
        by_bn.setdefault(id(pair[1]._modules[pair[2]]), []).append(pair)
    # How many places (child slots of the model's modules, each module once) hold each module.
    uses = Counter(id(child) for parent in module.modules() for child in parent._modules.values())
    fused: list[list[_Pair]] = []
    shared: list[list[_Pair]] = []
    for bn_id, pairs in by_bn.items():
        kinds = {activation_of(seq._modules[act_key]) for _, seq, _, act_key in pairs}
        (fused if uses[bn_id] == len(pairs) and len(kinds) == 1 else shared).append(pairs)
    bad = []
    for (name, seq, key, _), *_ in fused:
        bn: Any = seq._modules[key]
        low = 0 if bn.weight is None else int((bn.weight.detach() < bn.eps).sum())
        if low:
            bad.append(f"{name + '.' if name else ''}{key} ({low} of {bn.num_features} channels)")
    if bad and strict:
        raise ValueError(
            "syncbn: cannot fuse these BatchNorm layers into in-place layers exactly: their scale "
            "becomes |weight| + eps, so every weight must be at least eps (got smaller weights in "
            + ", ".join(bad)
            + "). Pass strict=False to clamp those weights to 0 (this changes the model), "
            "or keep them unfused"
        )
    if bad:
        warnings.warn(
            "syncbn: fused BatchNorm layers with weights below eps, clamped to 0 (the scale becomes eps): "
            + ", ".join(bad),
            stacklevel=2,
        )
    if shared:
        warnings.warn(
            "syncbn: left these BatchNorm layers unfused: each is also used outside a BatchNorm -> "
            "LeakyReLU/ELU pair, or with different activations, where its fused weight (w - eps) "
            "would change the model: "
            + ", ".join(f"{name + '.' if name else ''}{key}" for (name, _, key, _), *_ in shared),
            stacklevel=2,
        )
    for pairs in fused:
        _, first, key, act_key = pairs[0]
        new = _fused(first._modules[key], first._modules[act_key], process_group)
        for _, seq, key, act_key in pairs:  # one layer object wherever the BatchNorm was
            seq._modules[key] = new
            seq._modules[act_key] = nn.Identity()
    name_layers(module)
    return module


def _fused(bn: Any, act: Any, process_group: Any) -> InPlaceSyncBatchNorm:
    activation, param = activation_of(act)  # type: ignore[misc]
    cls = InPlaceSyncBatchNorm2d if isinstance(bn, nn.BatchNorm2d) else InPlaceSyncBatchNorm
    group = process_group if process_group is not None else getattr(bn, "process_group", None)
    new = like(cls, bn, process_group=group, device="meta", activation=activation, activation_param=param)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.sub_(bn.eps).clamp_(min=0.0)
    for key in ("weight", "bias"):
        new._parameters[key] = bn._parameters.get(key)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[key] = bn._buffers.get(key)
    new.train(bn.training)
    return new
