"""Drop-in for MegEngine's ``SyncBatchNorm``: change only the import line, keep MegEngine's arguments::

    from syncbn.compat.megengine import SyncBatchNorm   # was: from megengine.module import SyncBatchNorm

It is :class:`syncbn.SyncBatchNorm` with MegEngine's constructor and semantics (momentum convention,
``freeze``, ``group``, ``name``, eval without running statistics); the Migration guide maps each of them.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..modules import SyncBatchNorm as _SyncBatchNorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_SyncBatchNorm):
    """Synchronized batch norm with MegEngine's constructor and momentum convention.

    Training statistics span every rank of ``group``, as ``nn.BatchNorm`` with
    ``momentum = 1 - momentum`` on the concatenation of all ranks' batches:

    .. math::
        \\text{running} = \\text{momentum} \\cdot \\text{running}
        + (1 - \\text{momentum}) \\cdot \\text{batch statistic}

    Args:
        num_features: number of channels :math:`C`.
        eps: added to the variance for numerical stability. Default: 1e-5.
        momentum: fraction of the old running statistics kept at each training step (MegEngine
            convention; the ``momentum`` attribute stores PyTorch's ``1 - momentum``, so
            :func:`syncbn.revert_sync_batchnorm` gives an equivalent ``nn.BatchNorm``). Default: 0.9.
        affine: learnable per-channel scale and shift. Default: ``True``.
        track_running_stats: keep running statistics; without them eval uses the whole group's batch
            statistics (and communicates). Default: ``True``.
        freeze: normalise with the running statistics, never update them nor communicate, and do not
            train weight and bias (``requires_grad=False``, so DDP expects no gradient). Default: ``False``.
        group: ``torch.distributed`` group (``None``: the default group); also ``process_group``.
        name: keyword-only; MegEngine's module name, a non-empty string or ``None``.
        device: keyword-only; device of the parameters and buffers.
        dtype: keyword-only; dtype of the parameters and buffers.

    Shape:
        - Input: :math:`(N, C)`, :math:`(N, C, L)` or :math:`(N, C, H, W)`.
        - Output: same as input.

    Raises:
        TypeError: ``momentum`` is not a real number; ``name`` is neither a string nor ``None``.
        ValueError: ``freeze=True`` with ``track_running_stats=False``; an empty
            ``name``; in forward, input that is not 2D, 3D or 4D.

    Example::

        >>> bn = SyncBatchNorm(16, momentum=0.9)
        >>> y = bn(torch.randn(8, 16, 10, 10))
        >>> bn.momentum   # stored in PyTorch's convention
        0.09999999999999998
    """

    _input_dims = (2, 3, 4)
    _input_dims_text = "2D, 3D or 4D"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.9,
        affine: bool = True,
        track_running_stats: bool = True,
        freeze: bool = False,
        group: Any = None,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(momentum, numbers.Real) or isinstance(momentum, bool):
            raise TypeError(
                f"expected momentum to be a float in [0, 1] (MegEngine convention), "
                f"got {type(momentum).__name__}"
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"expected name to be a non-empty string or None, got {type(name).__name__}")
        if name is not None and not name.strip():
            raise ValueError(f"expected name to be a non-empty string or None, got {name!r}")
        super().__init__(
            num_features,
            eps,
            1.0 - float(momentum),
            affine,
            track_running_stats,
            process_group=group,
            device=device,
            dtype=dtype,
            freeze=freeze,
        )
        self.name = name

    # Batch norm under MegEngine's API: convert/revert swap it like the plain classes.
    _syncbn_plain_forward = True

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.training or self.running_mean is not None or self.running_var is not None:
            return super().forward(input, *args, **kwargs)  # type: ignore[no-any-return]
        # MegEngine: without running statistics, eval normalises with the whole group's batch statistics.
        self.training = True
        try:
            return super().forward(input, *args, **kwargs)  # type: ignore[no-any-return]
        finally:
            self.training = False

    @property
    def group(self) -> Any:
        """The ``torch.distributed`` group (``None``: the default group); same as ``process_group``."""
        return self.process_group

    @group.setter
    def group(self, value: Any) -> None:
        self.process_group = value

    def extra_repr(self) -> str:
        momentum = 1.0 - (self.momentum or 0.0)
        text = (
            f"{self.num_features}, eps={self.eps}, momentum={momentum:.6g} (MegEngine convention), "
            f"affine={self.affine}, track_running_stats={self.track_running_stats}"
        )
        return text + ", freeze=True" if self.freeze else text
