"""Drop-in for the ``sync_batchnorm`` package (Synchronized-BatchNorm-PyTorch).

Change only the import line (``from sync_batchnorm import ...`` becomes)::

    from syncbn.compat.sync_batchnorm import SynchronizedBatchNorm2d, DataParallelWithCallback, convert_model

The layers are :class:`syncbn.SyncBatchNorm1d`/``2d``/``3d``, whose first five constructor arguments are
that package's. They synchronise across the replicas of a plain ``nn.DataParallel`` (no replication
callback needed) and across ``torch.distributed`` processes; :class:`DataParallelWithCallback` and
:func:`patch_replication_callback` still run the package's callbacks for other modules. Numerics follow
``nn.BatchNorm`` (``eps`` added to the variance, not a clamp; float64 sums of centred moments, where the
original's cancel when ``|mean| >> std``). The Migration guide lists every difference.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._layer import check_module
from ..convert import _convert
from ..modules import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "DataParallelWithCallback",
    "patch_replication_callback",
    "convert_model",
    "patch_sync_batchnorm",
    "set_sbn_eps_mode",
    "CallbackContext",
    "execute_replication_callbacks",
]


_ARGS = """Args:
    num_features: number of channels :math:`C`.
    eps: added to the variance for numerical stability (never a clamp). Default: 1e-5.
    momentum: running-statistics update factor. Default: 0.1.
    affine: learnable per-channel scale and shift. Default: ``True``.
    track_running_stats: keep running statistics (the original warns that it
        does not support ``False``; here it works as in ``nn.BatchNorm``). Default: ``True``.
    process_group: ``torch.distributed`` group to synchronise over, ``None`` for the
        default group (not in the original, which has no process groups).
    device: device of the parameters and buffers.
    dtype: dtype of the parameters and buffers.
    bias: keyword-only; ``False`` drops the learnable shift. Default: ``True``.
    freeze: keyword-only; normalise with the running statistics and never
        communicate (:class:`syncbn.SyncBatchNorm`). Default: ``False``.

"""


def _doc(sync: type) -> str:
    """``sync``'s docstring under the package's name, with the package's arguments."""
    text = str(sync.__doc__)
    shape = text[text.index("Shape:") :].replace("syncbn.SyncBatchNorm", "SynchronizedBatchNorm")
    return f":class:`syncbn.{sync.__name__}` under the ``sync_batchnorm`` package's name.\n\n{_ARGS}{shape}"


class SynchronizedBatchNorm1d(SyncBatchNorm1d):
    __doc__ = _doc(SyncBatchNorm1d)


class SynchronizedBatchNorm2d(SyncBatchNorm2d):
    __doc__ = _doc(SyncBatchNorm2d)


class SynchronizedBatchNorm3d(SyncBatchNorm3d):
    __doc__ = _doc(SyncBatchNorm3d)


_TO_SYNCHRONIZED: list[tuple[type[_BatchNorm], type[SyncBatchNorm]]] = [
    (nn.BatchNorm1d, SynchronizedBatchNorm1d),
    (nn.BatchNorm2d, SynchronizedBatchNorm2d),
    (nn.BatchNorm3d, SynchronizedBatchNorm3d),
]


class CallbackContext:
    """What the copies of one submodule share during a replication callback: empty, for the
    ``__data_parallel_replicate__`` methods to store what they need on (copy 0 is called first)."""


def execute_replication_callbacks(replicas: Sequence[nn.Module]) -> None:
    """Call ``__data_parallel_replicate__(ctx, copy_id)`` on the replicas' submodules that define it.

    The package's replication protocol: submodule ``j`` of every copy gets the same
    :class:`CallbackContext`, and copy ``i`` is called with ``copy_id = i``, copy 0 first.

    Args:
        replicas: the copies of one module made by one replication, in replica order.

    Example::

        >>> replicas = torch.nn.parallel.replicate(model, [0, 1])
        >>> execute_replication_callbacks(replicas)
    """
    if not replicas:
        return
    contexts = [CallbackContext() for _ in replicas[0].modules()]
    for copy_id, replica in enumerate(replicas):
        for ctx, module in zip(contexts, replica.modules()):
            callback = getattr(module, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctx, copy_id)


class DataParallelWithCallback(nn.DataParallel):
    """``nn.DataParallel`` that runs the package's replication callbacks after each replication.

    Modules written for the package get their callbacks (:func:`execute_replication_callbacks`).

    Args:
        module: the module to replicate.
        device_ids: CUDA devices to replicate on (default: all).
        output_device: device the outputs are gathered on (default: ``device_ids[0]``).
        dim: dimension the inputs are scattered along. Default: 0.

    Example::

        >>> model = DataParallelWithCallback(model, device_ids=[0, 1])
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        replicas: list[nn.Module] = super().replicate(module, device_ids)
        execute_replication_callbacks(replicas)
        return replicas


def patch_replication_callback(data_parallel: nn.DataParallel) -> None:
    """Make an existing ``nn.DataParallel`` run the package's replication callbacks.

    Its ``replicate`` is wrapped as :class:`DataParallelWithCallback`'s is; one of those, or a module
    patched already, is left as it is (the callbacks run once).

    Args:
        data_parallel: the ``nn.DataParallel`` (or subclass) to patch.

    Raises:
        TypeError: ``data_parallel`` is not an ``nn.DataParallel``.

    Example::

        >>> model = nn.DataParallel(model, device_ids=[0, 1])
        >>> patch_replication_callback(model)
    """
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(
            "patch_replication_callback expected a torch.nn.DataParallel "
            f"(got {type(data_parallel).__name__})"
        )
    if isinstance(data_parallel, DataParallelWithCallback) or getattr(
        data_parallel.replicate, "_syncbn_runs_callbacks", False
    ):
        return
    replicate = data_parallel.replicate

    @functools.wraps(replicate)
    def replicate_with_callbacks(module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        replicas: list[nn.Module] = replicate(module, device_ids)
        execute_replication_callbacks(replicas)
        return replicas

    replicate_with_callbacks._syncbn_runs_callbacks = True  # type: ignore[attr-defined]
    data_parallel.replicate = replicate_with_callbacks  # type: ignore[method-assign]


def convert_model(module: nn.Module) -> nn.Module:
    """Swap a model's BatchNorm layers for ``SynchronizedBatchNorm*d`` layers.

    :func:`syncbn.convert_sync_batchnorm` with :class:`SynchronizedBatchNorm1d`/``2d``/``3d`` for
    ``nn.BatchNorm1d/2d/3d``. An ``nn.DataParallel`` root comes back as a
    :class:`DataParallelWithCallback` with the same ``device_ids``, ``output_device`` and ``dim``.

    Args:
        module: the model, possibly wrapped in ``nn.DataParallel``.

    Returns:
        The converted model (a new object when the root is a BatchNorm layer or an ``nn.DataParallel``).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        >>> model = convert_model(nn.DataParallel(model, device_ids=[0, 1]))
    """
    check_module(module, "convert_model")
    if isinstance(module, nn.DataParallel):
        inner = convert_model(module.module)
        # Without GPUs nn.DataParallel sets neither output_device nor dim.
        return DataParallelWithCallback(
            inner,
            device_ids=list(module.device_ids),
            output_device=getattr(module, "output_device", None),
            dim=getattr(module, "dim", 0),
        )
    return _convert(module, None, _TO_SYNCHRONIZED)


@contextlib.contextmanager
def patch_sync_batchnorm() -> Iterator[None]:
    """Within the block, ``torch.nn.BatchNorm1d/2d/3d`` build ``SynchronizedBatchNorm1d/2d/3d``.

    For models whose construction code cannot be edited; ``torch.nn``'s classes return on exit, even on error.

    Example::

        >>> with patch_sync_batchnorm():
        ...     model = build_model()   # its nn.BatchNorm2d(...) calls make synchronised layers
    """
    saved = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    nn.BatchNorm1d = SynchronizedBatchNorm1d  # type: ignore[misc,assignment]
    nn.BatchNorm2d = SynchronizedBatchNorm2d  # type: ignore[misc,assignment]
    nn.BatchNorm3d = SynchronizedBatchNorm3d  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = saved  # type: ignore[misc]


def set_sbn_eps_mode(mode: str) -> None:
    """Accept the package's eps-mode switch; syncbn always adds eps to the variance.

    ``"plus"`` (``sqrt(var + eps)``, as ``nn.BatchNorm``) is what syncbn does. ``"clamp"``
    (``sqrt(max(var, eps))``, the package's default) warns and changes nothing.

    Args:
        mode: ``"clamp"`` or ``"plus"``.

    Raises:
        ValueError: ``mode`` is neither.

    Example::

        >>> set_sbn_eps_mode("plus")
    """
    if mode not in ("clamp", "plus"):
        raise ValueError(f"set_sbn_eps_mode expected 'clamp' or 'plus' (got {mode!r})")
    if mode == "clamp":
        warnings.warn(
            "syncbn always adds eps to the variance, as nn.BatchNorm does; "
            "set_sbn_eps_mode('clamp') has no effect",
            stacklevel=2,
        )
