"""Swap BatchNorm layers for syncbn layers and back, *moving* each layer's state: only the class changes."""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase
from torch.nn.utils import parametrize

from . import groups
from ._abn_layer import ActivatedBatchNormBase
from ._checks import name_layers
from ._layer import check_module, like
from .activated import InPlaceSyncBatchNorm, plain_equivalent
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d, set_converter

__all__ = ["BatchNorm", "ConversionWarning", "convert_sync_batchnorm", "revert_sync_batchnorm"]


class ConversionWarning(UserWarning):
    """A layer was left unconverted because swapping its class would change its behaviour."""


class BatchNorm(_BatchNorm):
    """Plain (unsynchronised) batch normalization for input of any rank of at least 2.

    What :func:`revert_sync_batchnorm` turns the generic :class:`syncbn.SyncBatchNorm` and
    ``torch.nn.SyncBatchNorm`` into: ``nn.BatchNorm1d/2d/3d`` (same kernels, parameters, buffers,
    ``state_dict`` keys) without the dimension check. Scriptable with ``torch.jit.script``.

    Args:
        num_features: number of channels :math:`C` of an input :math:`(N, C, *)`.
        eps: value added to the variance for numerical stability. Default: 1e-5.
        momentum: running-statistics update factor, or ``None`` (cumulative moving average). Default: 0.1.
        affine: learnable per-channel scale and shift. Default: ``True``.
        track_running_stats: keep running mean and variance for eval. Default: ``True``.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.

    Shape:
        - Input: :math:`(N, C, *)`, at least 2 dimensions.
        - Output: same shape as the input.

    Example::

        >>> bn = syncbn.convert.BatchNorm(3).eval()
        >>> y = bn(torch.randn(2, 3, 4, 4, 4, 4))   # 6D input
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


# Forwards with no behaviour beyond batch norm (a class says so with ``_syncbn_plain_forward = True``).
_PLAIN_FORWARDS = frozenset({_BatchNorm.forward, nn.SyncBatchNorm.forward, SyncBatchNorm.forward})

_ClassTable = list[tuple[type[_BatchNorm], type[SyncBatchNorm]]]  # (plain class, its syncbn class)
_TO_SYNC: _ClassTable = [
    (nn.BatchNorm1d, SyncBatchNorm1d),
    (nn.BatchNorm2d, SyncBatchNorm2d),
    (nn.BatchNorm3d, SyncBatchNorm3d),
]


@functools.cache
def _syncbn_only_keys() -> frozenset[str]:
    """Instance attributes a syncbn layer has and a plain BatchNorm has not."""
    sync, plain = SyncBatchNorm(1, device="meta").__dict__, BatchNorm(1, device="meta").__dict__
    return frozenset(set(sync) - set(plain))


def _path(prefix: str) -> str:
    return f"'{prefix}'" if prefix else "the root module"


def _timm_act_classes() -> tuple[type[_BatchNorm], ...]:
    """timm's norm-plus-activation BatchNorm classes, if timm is loaded (else no layer is one)."""
    norm_act = sys.modules.get("timm.layers.norm_act")  # None: no class found
    found = (getattr(norm_act, name, None) for name in ("BatchNormAct2d", "SyncBatchNormAct"))
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, _BatchNorm))


def _is_timm_act(layer: nn.Module) -> bool:
    """Whether ``layer`` is a timm ``BatchNormAct2d``/``SyncBatchNormAct`` with timm's own forward."""
    classes = _timm_act_classes()
    return isinstance(layer, classes) and type(layer).forward in {cls.forward for cls in classes}


def _is_sync_act(layer: nn.Module) -> bool:
    """Whether ``layer`` is syncbn's ``SyncBatchNormAct2d`` with its own forward."""
    module = sys.modules.get("syncbn.integrations.timm")
    cls = getattr(module, "SyncBatchNormAct2d", None)
    return cls is not None and isinstance(layer, cls) and type(layer).forward is cls.forward


def _checks_as(layer: nn.Module, cls: type[_BatchNorm]) -> bool:
    """Whether ``layer`` is a ``cls`` that checks its input as ``cls`` does."""
    return isinstance(layer, cls) and type(layer)._check_input_dim is cls._check_input_dim


def _unparametrized_class(layer: nn.Module) -> type:
    """The layer's class before ``torch.nn.utils.parametrize`` wrapped it in a generated subclass."""
    cls = type(layer)
    if parametrize.is_parametrized(layer) and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}":
        return cls.__bases__[0]
    return cls


def _keeps_behaviour(layer: _BatchNorm, prefix: str, left: list[str]) -> bool:
    """Whether swapping ``layer``'s class keeps its behaviour; when not, say why in ``left``."""
    plain = type(layer).forward in _PLAIN_FORWARDS or getattr(layer, "_syncbn_plain_forward", False)
    if plain or _is_timm_act(layer) or _is_sync_act(layer):
        return True
    left.append(
        f"syncbn: left {_path(prefix)} ({type(layer).__qualname__}) as it is because "
        f"{type(layer).__qualname__} defines its own forward; swapping its class would drop that "
        "behaviour. Convert it by hand if needed."
    )
    return False


def _transplant(old: nn.Module, new: nn.Module, skip: frozenset[str]) -> None:
    """Move ``old``'s instance attributes but ``skip`` into ``new`` (the containers themselves: hook
    handles taken on ``old`` still work), and its parametrized properties."""
    new.__dict__.update({key: value for key, value in old.__dict__.items() if key not in skip})
    if not parametrize.is_parametrized(old):
        return
    # The ParametrizationList modules moved with ``_modules``; add the generated class and properties.
    parametrize._inject_new_class(new)
    for name in old.parametrizations:  # type: ignore[union-attr]
        parametrize._inject_property(new, name)


# The class a converted layer reverts to, when it is not the default for its syncbn class.
_REVERTS_TO = "_syncbn_reverts_to"


def _to_sync(
    layer: _BatchNorm, prefix: str, left: list[str], process_group: Any, classes: _ClassTable
) -> nn.Module:
    if isinstance(layer, SyncBatchNorm) or not _keeps_behaviour(layer, prefix, left):
        return layer
    original = _unparametrized_class(layer)
    keep = process_group is None and isinstance(layer, nn.SyncBatchNorm)  # the group it was built with
    group = layer.process_group if keep else process_group
    if _is_timm_act(layer):
        from .integrations.timm import SyncBatchNormAct2d

        # Built without __init__ (timm's signature); the syncbn attributes come from a template.
        new: SyncBatchNorm = SyncBatchNormAct2d.__new__(SyncBatchNormAct2d)
        template = SyncBatchNorm(1, process_group=group, device="meta")
        new.__dict__.update({key: template.__dict__[key] for key in _syncbn_only_keys()})
    else:
        target = next((sync for plain, sync in classes if _checks_as(layer, plain)), SyncBatchNorm)
        new = like(target, layer, process_group=group, device="meta")
    _transplant(layer, new, _syncbn_only_keys() | {_REVERTS_TO})
    # torch's and timm's synchronised classes revert to the plain default; others to themselves.
    if not isinstance(layer, nn.SyncBatchNorm) and original is not _plain_class_of(new):
        new.__dict__[_REVERTS_TO] = original
    return new


def _plain_class_of(layer: nn.Module) -> type[_BatchNorm]:
    """The plain class a syncbn layer reverts to when it remembers none."""
    if _is_sync_act(layer):
        return _timm_act_classes()[0]
    for plain, sync in _TO_SYNC:
        if _checks_as(layer, sync) and getattr(type(layer), "_input_dims", None) == sync._input_dims:
            return plain
    return BatchNorm


def _to_plain(layer: nn.Module, prefix: str, left: list[str]) -> nn.Module:
    if isinstance(layer, InPlaceSyncBatchNorm):  # -> Sequential(BatchNorm(|w| + eps), activation)
        return plain_equivalent(layer, BatchNorm)
    if not isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)) or not _keeps_behaviour(layer, prefix, left):
        return layer
    remembered = layer.__dict__.get(_REVERTS_TO)
    if isinstance(remembered, type) and issubclass(remembered, _BatchNorm):
        # The class the layer was converted from, built without its (unknown) __init__.
        new: _BatchNorm = remembered.__new__(remembered)
    else:
        target = _plain_class_of(layer)
        new = target.__new__(target) if _is_sync_act(layer) else like(target, layer, device="meta")
    family_keys = frozenset(getattr(type(layer), "_syncbn_family_keys", ()))  # e.g. renorm's r_max, d_max
    _transplant(layer, new, _syncbn_only_keys() | family_keys | {"process_group", _REVERTS_TO})
    return new


def _replace(
    module: nn.Module, swap: Callable[[nn.Module, str, list[str]], nn.Module], user_depth: int
) -> nn.Module:
    """Apply ``swap`` to every module, depth first, keeping shared modules shared; then warn of each
    layer ``swap`` left as it was, at the user's line (``user_depth`` frames above the caller)."""
    done: dict[int, nn.Module] = {}
    left: list[str] = []

    def visit(mod: nn.Module, prefix: str) -> nn.Module:
        if id(mod) in done:
            return done[id(mod)]
        new = done[id(mod)] = swap(mod, prefix, left)
        for name, child in list(new._modules.items()):
            if child is not None:
                new._modules[name] = visit(child, f"{prefix}.{name}" if prefix else name)
        return new

    replaced = visit(module, "")
    for message in left:
        warnings.warn(message, ConversionWarning, stacklevel=2 + user_depth)
    return replaced


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: Any = None,
    *,
    group_size: int | str | None = None,
    device_mesh: Any = None,
) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a syncbn layer.

    ``nn.BatchNorm1d/2d/3d`` become :class:`~syncbn.SyncBatchNorm1d`/``2d``/``3d``;
    ``torch.nn.SyncBatchNorm`` and other ``_BatchNorm`` subclasses the generic :class:`~syncbn.SyncBatchNorm`;
    timm's ``BatchNormAct2d`` :class:`syncbn.integrations.timm.SyncBatchNormAct2d`. Each layer keeps its
    ``Parameter`` objects (optimizers built before keep working), buffers, ``requires_grad``, mode, device,
    dtype, hooks, parametrizations and user-set attributes; a layer used at several places stays shared.
    Layers are named for error messages (:func:`syncbn.name_layers`) and remember their class for
    :func:`revert_sync_batchnorm`. A BatchNorm subclass with its own ``forward`` is left alone, with a
    :class:`ConversionWarning`. The Migration guide page of the documentation lists every case.

    Args:
        module: the model (or a single BatchNorm layer, which is converted and returned). Converted in
            place, except for a root that is itself a BatchNorm layer.
        process_group: ``torch.distributed`` group the new layers synchronise over; ``None`` is the
            default group, looked up at call time (a ``torch.nn.SyncBatchNorm`` then keeps the group it
            was built with). :class:`~syncbn.InPlaceSyncBatchNorm` layers (and the compat
            ``InPlaceABNSync``) stay as they are, taking ``process_group`` when it is given. A
            ``torch.distributed.device_mesh.DeviceMesh`` is taken as ``device_mesh``.
        group_size: ``k`` (groups of k consecutive ranks) or ``"node"``: the same as
            ``process_group=syncbn.groups.subgroup(group_size)``, whose rules apply (every rank calls
            it, after ``init_process_group``; not with ``process_group``).
        device_mesh: a ``DeviceMesh`` of the data-parallel ranks: a 1-D mesh or submesh (``mesh["dp"]``)
            synchronises over its group, a multi-dimensional one (HSDP's ``mesh["dp_replicate",
            "dp_shard"]``) over all its ranks (one flattened group, made at the first training call on
            every rank of the job and cached). The layers keep the mesh, resolved when they run, so
            they pickle and deep-copy. Not with ``process_group`` or ``group_size``.

    Returns:
        ``module`` with its BatchNorm layers swapped, or the new layer when ``module`` is itself one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``device_mesh`` is not a ``DeviceMesh``.
        ValueError: the model holds an uninitialised ``nn.LazyBatchNorm*d`` (run one forward pass
            first), or more than one of ``process_group``, ``group_size`` and ``device_mesh`` is given.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> model = syncbn.convert_sync_batchnorm(model)
        >>> type(model[1]).__name__
        'SyncBatchNorm2d'
        >>> # 2-D parallelism: statistics over the data-parallel ranks only
        >>> mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "tp"))
        >>> model = syncbn.convert_sync_batchnorm(model, device_mesh=mesh["dp"])
    """
    check_module(module, "convert_sync_batchnorm")
    if device_mesh is not None:
        process_group = groups.mesh_argument(device_mesh, process_group, group_size, "convert_sync_batchnorm")
    process_group = groups.group_for(process_group, group_size, "convert_sync_batchnorm")
    return _convert(module, process_group, _TO_SYNC)


def _from_the_classmethod(module: nn.Module, process_group: Any = None) -> nn.Module:
    """``SyncBatchNorm.convert_sync_batchnorm``, torch's spelling: warnings at its caller's line."""
    check_module(module, "convert_sync_batchnorm")
    return _convert(module, process_group, _TO_SYNC, user_depth=3)


set_converter(_from_the_classmethod)


def _convert(
    module: nn.Module, process_group: Any, classes: _ClassTable, *, user_depth: int = 2
) -> nn.Module:
    """:func:`convert_sync_batchnorm` with a class table; warnings ``user_depth`` frames above this one."""
    # Check everything first: an error leaves the model untouched.
    for name, mod in module.named_modules():
        if isinstance(mod, _LazyNormBase) and mod.has_uninitialized_params():
            raise ValueError(
                f"syncbn: cannot convert the uninitialised {type(mod).__name__} at {_path(name)}: "
                "its number of features is not known yet; run one forward pass (or build the model "
                "with nn.BatchNorm*d) before converting (expected an initialised layer, got one with "
                "uninitialised parameters)"
            )

    def swap(mod: nn.Module, prefix: str, left: list[str]) -> nn.Module:
        if isinstance(mod, _BatchNorm):
            return _to_sync(mod, prefix, left, process_group, classes)
        if isinstance(mod, ActivatedBatchNormBase) and mod._group_attr and process_group is not None:
            # already synchronised (InPlaceSyncBatchNorm, compat InPlaceABNSync): only the group is set
            setattr(mod, mod._group_attr, process_group)
        return mod

    converted = _replace(module, swap, user_depth)
    name_layers(converted)  # error messages and debug mode name layers as in this model
    return converted


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every syncbn layer (and ``torch.nn.SyncBatchNorm``) of ``module`` by plain BatchNorm.

    For CPU inference, ``torch.jit.script``/``torch.export``/ONNX export and deployment without
    ``torch.distributed``. :class:`~syncbn.SyncBatchNorm1d`/``2d``/``3d`` (and subclasses that only add
    constructor conveniences, such as the ``syncbn.compat.sync_batchnorm`` classes) become
    ``nn.BatchNorm1d/2d/3d``; a converted layer becomes the class it was converted from; the generic
    :class:`~syncbn.SyncBatchNorm`, ``torch.nn.SyncBatchNorm`` and other syncbn subclasses become
    :class:`syncbn.convert.BatchNorm`; an :class:`~syncbn.InPlaceSyncBatchNorm` becomes
    ``nn.Sequential(BatchNorm, activation)`` computing the same function (weight ``|w| + eps``;
    ``state_dict`` keys gain ``.0``). State is kept as by :func:`convert_sync_batchnorm`;
    ``process_group`` and ``freeze`` are dropped (a reverted layer in training updates its running
    statistics and trains weight and bias even if the syncbn layer was frozen). Converting then
    reverting leaves ``state_dict`` and eval outputs bit-identical.

    Args:
        module: the model, or a single syncbn layer (which is reverted and returned).

    Returns:
        ``module`` with its synchronised layers swapped, or the new layer when ``module`` is itself one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8))
        >>> plain = syncbn.revert_sync_batchnorm(model).eval()
        >>> scripted = torch.jit.script(plain)
    """
    check_module(module, "revert_sync_batchnorm")
    return _replace(module, _to_plain, user_depth=1)
