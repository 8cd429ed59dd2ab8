"""In-place activated synchronised batch norm: :class:`InPlaceSyncBatchNorm` and its 2d form.

Also the activation helpers :mod:`syncbn.convert` and :mod:`syncbn.fuse` use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._abn_layer import ActivatedBatchNormBase
from ._layer import like

__all__ = ["ActivatedBatchNormBase", "InPlaceSyncBatchNorm", "InPlaceSyncBatchNorm2d"]


class InPlaceSyncBatchNorm(ActivatedBatchNormBase):
    """Synchronised batch norm and an invertible activation as one in-place operation.

    .. math::
        y = \\phi\\Big(\\frac{x - \\mathrm{E}[x]}{\\sqrt{\\mathrm{Var}[x] + \\epsilon}}
            \\,(|\\gamma| + \\epsilon) + \\beta\\Big)

    written over the input and returned; backward keeps only :math:`y` (and per-channel vectors) and recovers
    the normalised input by inverting :math:`\\phi` and the affine map: about half the activation memory of
    ``SyncBatchNorm`` plus an activation. Statistics span the ``process_group`` as
    :class:`syncbn.SyncBatchNorm`'s; ``nn.DataParallel`` replicas synchronise with each other.

    The scale is :math:`|\\gamma| + \\epsilon` (as InPlace-ABN), so the inversion
    always exists. :func:`syncbn.fuse_batchnorm_activation` converts a trained
    ``BatchNorm`` + ``LeakyReLU``/``ELU`` pair; :func:`syncbn.revert_sync_batchnorm`
    turns the layer back into ``nn.Sequential(BatchNorm(weight = |γ| + ε), activation)``.

    The input is overwritten: it must be the output of an earlier operation
    (not a leaf that requires grad), and nothing else may need its old value.

    Args:
        num_features: number of channels :math:`C` of an input :math:`(N, C, *)`.
        eps: added to the variance and to :math:`|\\gamma|`. Default: 1e-5.
        momentum: running-statistics factor (torch's convention), or ``None``
            for a cumulative average. Default: 0.1.
        affine: learnable :math:`\\gamma` and :math:`\\beta`. Default: ``True``.
        track_running_stats: keep running statistics for eval. Default: ``True``.
        process_group: the ``torch.distributed`` group to synchronise over
            (``None``: the default group, looked up at call time).
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``. Default: ``"leaky_relu"``.
        activation_param: the negative slope of ``leaky_relu`` or the ``alpha``
            of ``elu`` (positive). Default: 0.01.

    Shape:
        - Input: :math:`(N, C, *)`, at least 2 dimensions.
        - Output: the input tensor itself, overwritten.

    Example::

        >>> layer = syncbn.InPlaceSyncBatchNorm2d(16)
        >>> h = torch.nn.Conv2d(3, 16, 3)(torch.randn(4, 3, 10, 10))
        >>> y = layer(h)          # y is h, overwritten
    """

    _group_attr = "process_group"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            activation,
            activation_param,
            device,
            dtype,
        )
        self.process_group = process_group


class InPlaceSyncBatchNorm2d(InPlaceSyncBatchNorm):
    """:class:`InPlaceSyncBatchNorm` for 4D input ``(N, C, H, W)`` (checks the rank as ``BatchNorm2d``).

    Shape:
        - Input: :math:`(N, C, H, W)`
        - Output: the input tensor itself, overwritten.

    Example::

        >>> layer = syncbn.InPlaceSyncBatchNorm2d(8, activation="elu", activation_param=1.0)
    """

    _input_dims = (4,)
    _input_dims_text = "4D"


def activation_module(activation: str, param: float) -> nn.Module:
    """The ``torch.nn`` module of an activation name (in place where torch offers it)."""
    if activation == "leaky_relu":
        return nn.LeakyReLU(param, inplace=True)
    if activation == "elu":
        return nn.ELU(param, inplace=True)
    if activation == "relu":
        return nn.ReLU(inplace=True)
    return nn.Identity()


def activation_of(module: nn.Module) -> tuple[str, float] | None:
    """``(name, param)`` of an ``nn.LeakyReLU`` (positive slope) or ``nn.ELU``; else ``None``."""
    if type(module) is nn.LeakyReLU and module.negative_slope > 0:
        return "leaky_relu", float(module.negative_slope)
    if type(module) is nn.ELU and module.alpha > 0:
        return "elu", float(module.alpha)
    return None


def plain_equivalent(layer: ActivatedBatchNormBase, generic: type[nn.Module]) -> nn.Module:
    """``nn.Sequential(batch norm with weight |w| + eps, activation)``: the layer's function, unsynchronised.

    ``generic`` (``syncbn.convert.BatchNorm``) is the class unless the layer checks for 4D input.
    The weight is a new ``Parameter``; bias and statistics are the layer's own.
    """
    cls = nn.BatchNorm2d if layer._input_dims == (4,) else generic
    ref = layer.weight if layer.weight is not None else layer.running_mean
    bn = like(cls, layer, **({} if ref is None else {"device": ref.device, "dtype": ref.dtype}))
    with torch.no_grad():
        if layer.weight is not None:
            bn.weight = nn.Parameter(layer.weight.abs() + layer.eps, requires_grad=layer.weight.requires_grad)
            bn.bias = layer.bias
        if layer.running_mean is not None:
            bn.running_mean, bn.running_var = layer.running_mean, layer.running_var
            bn.num_batches_tracked = layer.num_batches_tracked
    pair = nn.Sequential(bn, activation_module(layer.activation, float(layer.activation_param)))
    return pair.train(layer.training)
