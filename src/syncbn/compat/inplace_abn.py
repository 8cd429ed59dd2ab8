"""The API of the ``inplace-abn`` package (InPlace-ABN, Rota Bulò et al., CVPR 2018) over syncbn.

Change only the import of code written against ``from inplace_abn import ABN, InPlaceABN, InPlaceABNSync``::

    from syncbn.compat.inplace_abn import ABN, InPlaceABN, InPlaceABNSync

Constructors, defaults, attributes, ``state_dict`` keys (version-1 checkpoints too),
``extra_repr`` and ``set_group`` are the package's. The in-place classes compute

.. math::
    y = \\phi\\Big(\\frac{x - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}}\\,(|w| + \\epsilon) + b\\Big)

over their input (returned, marked dirty), keeping only :math:`y` for backward; ``ABN`` is batch norm
with the plain weight, then the activation (``relu`` allowed). ``InPlaceABNSync`` runs syncbn's exact
synchronisation (one ``all_reduce`` of ``O(C)`` values, uneven and empty per-rank batches), on CPU and
GPU, with no C++/CUDA build. The memory guide (Migrating from inplace-abn) lists the differences.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _fx, groups
from .._abn_layer import ActivatedBatchNormBase
from ..families.inplace_abn import activate_, check_activation
from ..functional import check_per_channel, inplace_abn_apply

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "inplace_abn", "inplace_abn_sync"]


class ABN(ActivatedBatchNormBase):
    """Activated batch norm: ``nn.BatchNorm`` (plain weight) followed by an activation, not in place.

    Args:
        num_features: number of channels :math:`C`.
        eps: added to the variance. Default: 1e-5.
        momentum: running-statistics factor, or ``None`` for a cumulative average. Default: 0.1.
        affine: learnable weight and bias. Default: ``True``.
        track_running_stats: keep running statistics (without them, eval uses the batch's). Default: ``True``.
        activation: ``"relu"``, ``"leaky_relu"``, ``"elu"`` or ``"identity"``. Default: ``"leaky_relu"``.
        activation_param: the negative slope of ``leaky_relu`` or the ``alpha`` of ``elu``. Default: 0.01.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape.

    Example::

        >>> from syncbn.compat.inplace_abn import ABN
        >>> y = ABN(8, activation="relu")(torch.randn(4, 8, 5, 5))
    """

    _in_place = False
    _repr_tracking = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation, activation_param
        )

    def forward(self, x: Tensor) -> Tensor:
        """Batch norm, then the activation (in place on batch norm's output)."""
        if isinstance(x, torch.fx.Proxy):  # torch.fx tracing: a leaf, as torch.nn's layers
            return _fx.leaf_call(self, ABN.forward, x)
        self._check_input_dim(x)
        self._check_activation()
        if self.training:
            y = self._training_call().batch_norm(x, self.weight, self.bias, self.eps)
        else:  # the running statistics, or without them the batch's
            mean, var = self.running_mean, self.running_var
            y = F.batch_norm(x, mean, var, self.weight, self.bias, mean is None, 0.0, self.eps)
        return activate_(y, None, None, self.activation, self.activation_param)


class InPlaceABN(ABN):
    """In-place activated batch norm, local to this process (as the package's ``InPlaceABN``).

    Same arguments as :class:`ABN`, but the activation must be invertible (``relu`` raises
    ``ValueError``) and the scale is ``|weight| + eps``. The input is overwritten and returned.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: the input tensor, overwritten.

    Example::

        >>> layer = InPlaceABN(8)
        >>> y = layer(torch.nn.Conv2d(3, 8, 3)(torch.randn(4, 3, 9, 9)))
    """

    _in_place = True
    _local = True
    forward = ActivatedBatchNormBase.forward


class InPlaceABNSync(ABN):
    """In-place activated batch norm synchronised over ``group`` (as the package's ``InPlaceABNSync``).

    :class:`InPlaceABN` with training statistics over every rank of ``group`` (local without a process group).

    Args:
        num_features: number of channels :math:`C`.
        eps: added to the variance and to ``|weight|``. Default: 1e-5.
        momentum: running-statistics factor, or ``None``. Default: 0.1.
        affine: learnable weight and bias. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``. Default: ``"leaky_relu"``.
        activation_param: slope or alpha. Default: 0.01.
        group: the ``torch.distributed`` group, or ``None`` for the default group (looked up at call time).

    Shape:
        - Input: :math:`(N, C, *)`; per-rank batch sizes may differ (or be 0).
        - Output: the input tensor, overwritten.

    Example::

        >>> layer = InPlaceABNSync(64, group=None)   # under torchrun: every rank's batch
    """

    _in_place = True
    _group_attr = "group"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        group: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation, activation_param
        )
        self.group = group

    def set_group(self, group: Any) -> None:
        """Set the group to synchronise over (never between a forward and its backward).

        Args:
            group: a ``torch.distributed`` group, or ``None`` for the default group.
        """
        self.group = group

    forward = ActivatedBatchNormBase.forward


def _samples(x: Tensor, name: str, training: bool) -> None:
    if training and x.dim() >= 2 and x.numel() // max(x.shape[1], 1) == 1:
        raise ValueError(
            f"{name} is trying to compute batch statistics, but the input tensor only contains a "
            f"single sample per channel (input size {list(x.shape)})"
        )


def _check_sizes(x: Tensor, *tensors: Tensor | None) -> None:
    """Bias and running statistics with one element per channel (the weight: the engine's check)."""
    if x.dim() >= 2:  # else the engine's check names the dimensions
        check_per_channel(x.shape[1], dict(zip(("bias", "running_mean", "running_var"), tensors)))


# The arguments both functions take, put at the top of their Args sections.
_ARGS = """    Args:
        x: input ``(N, C, *)``, overwritten.
        weight: per-channel weight or ``None``.
        bias: per-channel bias or ``None``.
        running_mean: running mean or ``None``.
        running_var: running variance or ``None``.
        training: batch statistics (and update the running ones) or the running ones.
        momentum: the update factor.
        eps: added to the variance and to ``|weight|``.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
        activation_param: slope or alpha.
"""
_F = TypeVar("_F", bound=Callable[..., Tensor])


def _with_args(function: _F) -> _F:
    function.__doc__ = (function.__doc__ or "").replace("    Args:\n", _ARGS, 1)
    return function


@_with_args
def inplace_abn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
) -> Tensor:
    """In-place activated batch norm of ``x`` (local), written over ``x`` and returned.

    ``x <- act((x - mu) / sqrt(var + eps) * (|weight| + eps) + bias)``, ``mu`` and ``var`` the
    batch's (``training``) or the running statistics, which training updates as
    ``running <- (1 - momentum) * running + momentum * batch`` (unbiased variance).

    Args:

    Shape:
        - Input: :math:`(N, C, *)`; output: the input tensor.

    Example::

        >>> h = torch.randn(4, 8, 5, 5) * 1.0
        >>> y = inplace_abn(h, None, None, None, None)
    """
    check_activation(activation, activation_param)
    _samples(x, "inplace_abn", training)
    _check_sizes(x, bias, running_mean, running_var)
    stats = (running_mean, running_var, training, momentum, eps)
    return inplace_abn_apply(x, weight, bias, *stats, activation, activation_param, None)


@_with_args
def inplace_abn_sync(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    group: Any = None,
) -> Tensor:
    """:func:`inplace_abn` with training statistics over every rank of ``group``.

    Without an initialised process group it warns (``RuntimeWarning``, as the package) and runs the
    local :func:`inplace_abn`. Per-rank batch sizes may differ, and may be 0 on some ranks.

    Args:
        group: the ``torch.distributed`` group, or ``None`` for the default group.

    Shape:
        - Input: :math:`(N, C, *)`; output: the input tensor.

    Example::

        >>> y = inplace_abn_sync(h, w, b, rm, rv, group=None)   # on every rank of the default group
    """
    check_activation(activation, activation_param)
    _check_sizes(x, bias, running_mean, running_var)
    if not groups.is_initialized():
        warnings.warn(
            "inplace_abn_sync is being called, but torch.distributed is not initialized: running the "
            "non-synchronized inplace_abn",
            RuntimeWarning,
            stacklevel=2,
        )
    sum_group = groups.resolve(group) if training else None
    if sum_group is None:
        _samples(x, "inplace_abn_sync", training)
    stats = (running_mean, running_var, training, momentum, eps)
    return inplace_abn_apply(x, weight, bias, *stats, activation, activation_param, sum_group)
