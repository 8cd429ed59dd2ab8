"""Synchronised Batch Renormalization: :class:`SyncBatchRenorm` (1d/2d/3d too), :func:`convert_to_renorm`.

:class:`~syncbn.SyncBatchNorm` layers of the ``renorm`` family (:mod:`syncbn.families.renorm`): Ioffe's
``r`` and ``d`` correct the batch statistics, on the same engine and paths.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor, nn

from . import _checks, _config, groups
from .families import BATCH_NORM, Renorm
from .modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d

__all__ = [
    "SyncBatchRenorm",
    "SyncBatchRenorm1d",
    "SyncBatchRenorm2d",
    "SyncBatchRenorm3d",
    "convert_to_renorm",
]


def _limit(name: str, value: Any, least: float) -> float:
    """``value`` as a float, or ``ValueError`` naming what is expected (``least`` or more) and what came."""
    if type(value) is not float:  # the per-call fast path is this one type test
        if not isinstance(value, numbers.Real):  # NumPy scalars are; tensors, strings, None are not
            hint = (
                " (a tensor would be read back from its device on every training call)"
                if isinstance(value, torch.Tensor)
                else ""
            )
            raise ValueError(
                f"expected {name} to be a real number >= {least:g}: a Python float or int, or a NumPy "
                f"scalar (got {value!r} of type {type(value).__module__}.{type(value).__qualname__}); "
                f"pass float(...) of it{hint}"
            )
        value = float(value)
    if not value >= least:  # NaN fails the comparison too
        raise ValueError(f"expected {name} >= {least:g} (got {value!r})")
    return value


def _check_limits(r_max: Any, d_max: Any) -> tuple[float, float]:
    """``(r_max, d_max)`` as floats; ``ValueError`` for a limit that is not a real number >= 1 / >= 0."""
    return _limit("r_max", r_max, 1.0), _limit("d_max", d_max, 0.0)


class SyncBatchRenorm(SyncBatchNorm):
    """Batch Renormalization (Ioffe, 2017) whose training statistics span a process group.

    In training, with the global batch's mean :math:`\\mu_B` and biased variance
    :math:`\\sigma_B^2` (every rank's batch together, as :class:`~syncbn.SyncBatchNorm`)
    and the running statistics :math:`\\mu, \\sigma^2` *before* this step's update:

    .. math::
        r = \\mathrm{clip}_{[1/r_{max}, r_{max}]}\\Big(\\frac{\\sqrt{\\sigma_B^2 + \\epsilon}}
            {\\sqrt{\\sigma^2 + \\epsilon}}\\Big), \\quad
        d = \\mathrm{clip}_{[-d_{max}, d_{max}]}\\Big(
            \\frac{\\mu_B - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}}\\Big)

    .. math::
        y = \\gamma \\Big(\\frac{x - \\mu_B}{\\sqrt{\\sigma_B^2 + \\epsilon}}\\, r + d\\Big) + \\beta

    :math:`r` and :math:`d` are constants in backward. The running statistics update as ``nn.BatchNorm``'s
    (``momentum=None`` cumulative); eval is ``nn.BatchNorm`` with them. With ``r_max=1``, ``d_max=0`` (or
    ``track_running_stats=False``: :math:`r = 1, d = 0`) this is exactly :class:`~syncbn.SyncBatchNorm`. One
    collective each way; without a process group the same math runs locally.

    ``r_max`` and ``d_max`` are plain attributes: change them between steps for the paper's warm-up (start at
    1 and 0, relax towards e.g. 3 and 5), alike on every rank (checked at the first training call, and on
    every call in debug mode). Any real number is taken (a NumPy scalar too); a tensor is refused
    (``ValueError``: pass ``float(value)``). In debug mode, NaN/Inf or negative running statistics (which
    :math:`r, d` read) raise ``ValueError``. Under activation checkpointing the recomputation takes
    :math:`r, d` from the running statistics the layer's last forward saw (exact for a layer called once per
    checkpointed step).

    Args:
        num_features: number of channels :math:`C` of an input :math:`(N, C, *)`.
        eps: value added to the variances. Default: 1e-5.
        momentum: running-statistics update factor, or ``None`` for a cumulative moving average. Default: 0.1.
        affine: learnable :math:`\\gamma` and :math:`\\beta`. Default: ``True``.
        track_running_stats: keep running statistics (without them, batch norm). Default: ``True``.
        process_group: ``torch.distributed`` group whose ranks share statistics;
            ``None`` is the default group, looked up at call time.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        r_max: the clamp of :math:`r`, a real number at least 1. Default: 3.0.
        d_max: the clamp of :math:`d`, a real number at least 0. Default: 5.0.
        bias: with ``affine``, a learnable :math:`\\beta` (``False``: none, as
            :class:`~syncbn.SyncBatchNorm`'s ``bias``). Default: ``True``.

    Shape:
        - Input: :math:`(N, C, *)`, at least 2 dimensions.
        - Output: same shape as the input.

    Example::

        >>> bn = syncbn.SyncBatchRenorm(16, r_max=1.0, d_max=0.0)   # warm-up: batch norm
        >>> y = bn(torch.randn(8, 16, 10, 10))
        >>> bn.r_max, bn.d_max = 3.0, 5.0                              # later in training
    """

    _syncbn_family_keys = ("r_max", "d_max", "_renorm_before")  # dropped by revert_sync_batchnorm

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
        r_max: float = 3.0,
        d_max: float = 5.0,
        bias: bool = True,
    ) -> None:
        r_max, d_max = _check_limits(r_max, d_max)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias=bias
        )
        self.r_max, self.d_max = r_max, d_max

    def _family_call(self, recomputing: bool = False, eager: bool = False) -> Any:
        r_max, d_max = _check_limits(self.r_max, self.d_max)
        if not self._reads_running_stats(r_max, d_max):
            return BATCH_NORM  # r = 1, d = 0: batch norm's own path, bit for bit
        running_mean, running_var = self.running_mean, self.running_var
        assert running_mean is not None and running_var is not None
        before = self.__dict__.get("_renorm_before")
        if recomputing and before is not None:  # after the step's update: the first forward's statistics
            running_mean, running_var = before
        elif eager:
            if _config.debug_enabled() and not isinstance(
                groups.resolve(self._group()), groups.ProcessGroupSum
            ):  # over a process group the consistency check tests them on every rank
                _checks.check_running_stats(self, running_mean, running_var)
            self.__dict__["_renorm_before"] = (_plain(running_mean), _plain(running_var))
        return Renorm(r_max, d_max, running_mean, running_var)

    def _syncbn_debug_running_stats(self) -> tuple[Tensor, Tensor] | None:
        """The running statistics this training call's ``r`` and ``d`` read (debug mode's check)."""
        reads = self._reads_running_stats(self.r_max, self.d_max)
        return (self.running_mean, self.running_var) if reads else None  # type: ignore[return-value]

    def _reads_running_stats(self, r_max: float, d_max: float) -> bool:
        """Whether a training call computes ``r`` and ``d`` (else it is batch norm: ``r = 1, d = 0``)."""
        return self.track_running_stats and not (r_max == 1.0 and d_max == 0.0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r_max={self.r_max:g}, d_max={self.d_max:g}"


def _doc(sync: type) -> str:
    """The docstring of ``sync``'s renorm twin: the same input rank, arguments and example."""
    return str(sync.__doc__).replace("SyncBatchNorm", "SyncBatchRenorm")


class SyncBatchRenorm1d(SyncBatchRenorm, SyncBatchNorm1d):
    __doc__ = _doc(SyncBatchNorm1d)


class SyncBatchRenorm2d(SyncBatchRenorm, SyncBatchNorm2d):
    __doc__ = _doc(SyncBatchNorm2d)


class SyncBatchRenorm3d(SyncBatchRenorm, SyncBatchNorm3d):
    __doc__ = _doc(SyncBatchNorm3d)


def _plain(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` outside autograd and every torch.func wrapper (the layer outlives them)."""
    tensor = tensor.detach().clone()  # under a transform the copy is wrapped too: unwrap it after
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


_RENORM_OF: dict[type, type] = {
    SyncBatchNorm: SyncBatchRenorm,
    SyncBatchNorm1d: SyncBatchRenorm1d,
    SyncBatchNorm2d: SyncBatchRenorm2d,
    SyncBatchNorm3d: SyncBatchRenorm3d,
}


def convert_to_renorm(
    module: nn.Module, process_group: Any = None, *, r_max: float = 3.0, d_max: float = 5.0
) -> nn.Module:
    """Turn every BatchNorm layer of ``module`` into a synchronised renorm layer.

    ``nn.BatchNorm1d/2d/3d`` (and :class:`~syncbn.SyncBatchNorm` layers) become
    :class:`SyncBatchRenorm1d`/``2d``/``3d``, torch's ``nn.SyncBatchNorm`` the generic
    :class:`SyncBatchRenorm`: :func:`syncbn.convert_sync_batchnorm` (whose rules apply), then each plain
    syncbn layer switches to its renorm twin with ``r_max`` and ``d_max`` set. Renorm layers keep theirs.
    :func:`syncbn.revert_sync_batchnorm` undoes it (to plain ``nn.BatchNorm*d``).

    Args:
        module: the model, or a single BatchNorm layer (converted and returned).
        process_group: as :func:`syncbn.convert_sync_batchnorm`.
        r_max: the clamp of ``r`` (1: no correction of the scale). Default: 3.0.
        d_max: the clamp of ``d`` (0: no correction of the shift). Default: 5.0.

    Returns:
        ``module`` with its BatchNorm layers swapped, or the new layer.

    Example::

        >>> model = syncbn.convert_to_renorm(model, r_max=1.0, d_max=0.0)  # warm-up: batch norm
        >>> for m in model.modules():                                        # later: relax
        ...     if isinstance(m, syncbn.SyncBatchRenorm):
        ...         m.r_max, m.d_max = 3.0, 5.0
    """
    r_max, d_max = _check_limits(r_max, d_max)
    converted = SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for layer in converted.modules():
        target = _RENORM_OF.get(type(layer))
        if target is not None:
            layer.__class__ = target
            layer.__dict__.update(r_max=r_max, d_max=d_max)
    return converted
