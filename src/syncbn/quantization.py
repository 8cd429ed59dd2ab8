"""Eager-mode quantization with syncbn's layers: ``fuse_modules``, ``fuse_modules_qat``, ``prepare_qat``.

Importing :mod:`syncbn` adds syncbn's layer types (only those) to ``torch.ao.quantization``'s fuser and
QAT tables. On a converted model, ``fuse_modules`` folds the batch norm in eval, as for ``nn.BatchNorm``;
``fuse_modules_qat`` gives :class:`ConvSyncBn2d` and its siblings, which ``prepare_qat`` turns into
torch's QAT modules whose ``bn`` is the synchronised layer itself (batch statistics over every rank).
``[bn, relu]`` pairs fuse in eval only, never for QAT (``ValueError``: torch's ``BNReLU`` holds a plain
batch norm, which does not synchronise). Renorm layers (:class:`~syncbn.SyncBatchRenorm` and its
1d/2d/3d classes) fold in eval, where they are batch norm with their running statistics; QAT fusion
refuses them (``ValueError``). The recipes page (FX, quantization and export) has details and limits.

Example::

    >>> import torch, syncbn
    >>> from torch.ao.quantization import fuse_modules_qat, get_default_qat_qconfig, prepare_qat
    >>> model = syncbn.convert_sync_batchnorm(
    ...     torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()))
    >>> model = fuse_modules_qat(model.train(), [["0", "1", "2"]])
    >>> model.qconfig = get_default_qat_qconfig("x86")
    >>> model = prepare_qat(model)   # model[0].bn is a syncbn.SyncBatchNorm2d
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
from torch import nn

from .convert import revert_sync_batchnorm
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d
from .renorm import SyncBatchRenorm, SyncBatchRenorm1d, SyncBatchRenorm2d, SyncBatchRenorm3d

__all__ = [
    "ConvSyncBn1d",
    "ConvSyncBn2d",
    "ConvSyncBn3d",
    "ConvSyncBnReLU1d",
    "ConvSyncBnReLU2d",
    "ConvSyncBnReLU3d",
    "LinearSyncBn1d",
    "fuser_methods",
    "qat_module_mappings",
]


def _check(first: nn.Module, bn: nn.Module, kind: type) -> None:
    if not (isinstance(first, kind) and isinstance(bn, SyncBatchNorm)):
        raise TypeError(
            f"expected a {kind.__name__} and a {SyncBatchNorm.__name__} "
            f"(got {type(first).__name__} and {type(bn).__name__})"
        )
    out = getattr(first, "out_channels", getattr(first, "out_features", None))
    if out != bn.num_features:  # type: ignore[attr-defined]
        raise ValueError(
            f"the batch norm's num_features must equal the {type(first).__name__}'s output channels "
            f"(got {bn.num_features} and {out})"  # type: ignore[attr-defined]
        )
    if not (bn.affine and bn.track_running_stats):  # type: ignore[attr-defined]
        raise ValueError(
            "QAT fusion needs a batch norm with affine=True and track_running_stats=True (got "
            f"affine={bn.affine}, track_running_stats={bn.track_running_stats})"  # type: ignore[attr-defined]
        )


_Method = Callable[..., nn.Module]  # a fuser method: (is_qat, *modules) -> the fused module

# ours -> (torch's float fused class, torch's QAT class of the same name)
_QAT: dict[type, tuple[type, type]] = {}


def _fused(torch_cls: type, kind: type) -> type:
    """Torch's fused ``torch_cls`` taking a ``kind`` (conv or linear) layer and a syncbn layer."""

    def __init__(self: nn.Sequential, *modules: nn.Module) -> None:
        _check(modules[0], modules[1], kind)
        nn.Sequential.__init__(self, *modules)  # torch's __init__ accepts its exact types only

    name = torch_cls.__name__.replace("Bn", "SyncBn")
    doc = _DOC.format(torch=torch_cls.__name__)
    ours = type(name, (torch_cls,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})
    _QAT[ours] = (torch_cls, getattr(nniqat, torch_cls.__name__))
    return ours


_DOC = """Torch's fused ``{torch}`` holding a synchronised batch norm (``fuse_modules_qat``'s output).

    ``prepare_qat`` turns it into torch's QAT ``{torch}`` whose ``bn`` is the synchronised layer itself.
    """
ConvSyncBn1d = _fused(nni.ConvBn1d, nn.Conv1d)
ConvSyncBn2d = _fused(nni.ConvBn2d, nn.Conv2d)
ConvSyncBn3d = _fused(nni.ConvBn3d, nn.Conv3d)
ConvSyncBnReLU1d = _fused(nni.ConvBnReLU1d, nn.Conv1d)
ConvSyncBnReLU2d = _fused(nni.ConvBnReLU2d, nn.Conv2d)
ConvSyncBnReLU3d = _fused(nni.ConvBnReLU3d, nn.Conv3d)
LinearSyncBn1d = _fused(nni.LinearBn1d, nn.Linear)


class _ToQAT(NamedTuple):
    """``prepare_qat``'s entry for one fused class: torch's QAT module around the synchronised layer."""

    plain: Any  # torch's float fused class
    qat: Any  # its QAT class

    def from_float(self, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> nn.Module:
        plain = self.plain.__new__(self.plain)  # torch's float fused class, the same children
        nn.Sequential.__init__(plain, *mod.children())
        plain.qconfig = mod.qconfig
        accepts = "use_precomputed_fake_quant" in inspect.signature(self.qat.from_float).parameters
        kwargs = {"use_precomputed_fake_quant": use_precomputed_fake_quant} if accepts else {}
        new: nn.Module = self.qat.from_float(plain, **kwargs)
        # from_float made a plain batch norm sharing the layer's Parameters and buffers: put the layer back.
        bn = mod[1]  # type: ignore[index]
        bn.train(new.bn.training)  # type: ignore[union-attr]
        new.bn = bn
        return new


def qat_module_mappings() -> dict[type, Any]:
    """``prepare_qat`` mapping entries for syncbn's fused classes (``mapping=`` takes them, merged)."""
    return {ours: _ToQAT(plain, qat) for ours, (plain, qat) in _QAT.items()}


def _fuser(renorm: bool, default: _Method, ours: type | None = None) -> _Method:
    """Torch's fuser ``default``; for QAT, syncbn's fused class ``ours`` or, for renorm, ``ValueError``."""
    if ours is None and not renorm:
        return default  # for QAT too (torch's own method, or its error)

    def fuse(is_qat: bool, *modules: nn.Module) -> nn.Module:
        if not is_qat:
            return default(is_qat, *modules)
        if renorm or ours is None:
            layer = next(m for m in modules if isinstance(m, SyncBatchRenorm))
            raise ValueError(
                "torch's QAT modules fold batch norm's training statistics, not Batch "
                "Renormalization's r and d: a renorm layer cannot be fused for QAT (got "
                f"{', '.join(type(m).__name__ for m in modules)}). Leave it unfused, or train "
                f"with SyncBatchNorm (r_max=1, d_max=0 is batch norm; {type(layer).__name__} "
                "folds in eval with fuse_modules)"
            )
        return ours(*modules)  # type: ignore[no-any-return]

    return fuse


def _bn_relu(torch_cls: type) -> _Method:
    def fuse(is_qat: bool, bn: nn.Module, relu: nn.Module) -> nn.Module:
        if is_qat:
            raise ValueError(
                f"torch has no QAT module for {torch_cls.__name__}: leave this [batch norm, ReLU] pair "
                f"unfused for QAT (got a {type(bn).__name__} and a {type(relu).__name__})"
            )
        if bn.training:  # the plain copy would train without synchronising (renorm: as batch norm)
            raise ValueError(
                f"fuse_modules makes {torch_cls.__name__} of a [batch norm, ReLU] pair around a plain "
                f"nn.BatchNorm that never synchronises: exact in eval only (expected the model in eval, "
                f"got a {type(bn).__name__} in training mode); call model.eval() first, or leave it unfused"
            )
        return torch_cls(revert_sync_batchnorm(bn), relu)  # type: ignore[no-any-return]

    return fuse


def fuser_methods() -> dict[tuple[type, ...], _Method]:
    """The fuser methods for syncbn's layers, keyed as ``torch.ao.quantization`` keys its own.

    Returns:
        A dict for ``fuse_modules(..., fuse_custom_config_dict={"additional_fuser_method_mapping": d})``
        (importing :mod:`syncbn` already adds these to torch's defaults).
    """
    from torch.ao.quantization import fuser_method_mappings as fm

    found: dict[tuple[type, ...], _Method] = {}
    families: tuple[tuple[type, tuple[type, ...]], ...] = (
        (SyncBatchNorm, (SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d)),
        (SyncBatchRenorm, (SyncBatchRenorm1d, SyncBatchRenorm2d, SyncBatchRenorm3d)),
    )
    for generic, by_dim in families:
        method = functools.partial(_fuser, generic is SyncBatchRenorm)
        for dim, sized in enumerate(by_dim, 1):
            conv = getattr(nn, f"Conv{dim}d")
            # The generic class too (mmengine's "ExactSyncBN" builds it).
            for bn in (sized, generic):
                found[(conv, bn)] = method(fm.fuse_conv_bn, globals()[f"ConvSyncBn{dim}d"])
                found[(conv, bn, nn.ReLU)] = method(fm.fuse_conv_bn_relu, globals()[f"ConvSyncBnReLU{dim}d"])
                found[(getattr(nn, f"ConvTranspose{dim}d"), bn)] = method(fm.fuse_convtranspose_bn)
            if dim > 1:
                found[(sized, nn.ReLU)] = method(_bn_relu(getattr(nni, f"BNReLU{dim}d")))
        for bn in (by_dim[0], generic):
            found[(nn.Linear, bn)] = method(fm.fuse_linear_bn, LinearSyncBn1d)
    return found


def register() -> bool:
    """Add syncbn's entries to ``torch.ao.quantization``'s default fuser and QAT tables (idempotent).

    Returns:
        Whether the tables were found (torch keeps them private; if a release moves them, pass
        :func:`fuser_methods` and :func:`qat_module_mappings` explicitly).
    """
    try:
        from torch.ao.quantization import fuser_method_mappings as fm
        from torch.ao.quantization import quantization_mappings as qm

        fusers, qat = fm._DEFAULT_OP_LIST_TO_FUSER_METHOD, qm.DEFAULT_QAT_MODULE_MAPPINGS
    except (ImportError, AttributeError):
        return False
    for key, method in fuser_methods().items():
        fusers.setdefault(key, method)
    for fused, entry in qat_module_mappings().items():
        qat.setdefault(fused, entry)
    return True


register()
