"""``SyncBatchNorm`` and its 1d/2d/3d classes."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _fx, groups, parallel
from ._layer import LayerMixin, dims_doc
from .engine import _rules
from .engine._function import BATCH_NORM, LOCAL, apply

try:
    from .engine import _compiled, _ops
except ImportError:  # torch without custom operators: compiled models run the eager layer (graph breaks)
    _ops = None  # type: ignore[assignment]
    _compiled = None  # type: ignore[assignment]
from .functional import apply_masked, check_eps, check_input

# torch >= 2.13 BatchNorm layers take a keyword-only ``bias``.
_BATCHNORM_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters

__all__ = ["SyncBatchNorm", "SyncBatchNorm1d", "SyncBatchNorm2d", "SyncBatchNorm3d"]

# SyncBatchNorm.convert_sync_batchnorm's function, handed down by syncbn.convert (imports flow one way).
_converter: Callable[[torch.nn.Module, Any], torch.nn.Module] | None = None


def set_converter(function: Callable[[torch.nn.Module, Any], torch.nn.Module]) -> None:
    """Install the function :meth:`SyncBatchNorm.convert_sync_batchnorm` calls."""
    global _converter
    _converter = function


_is_compiling = _rules.is_compiling  # (benchmarks/compile/compile_step.py replaces it)
_warn_while_tracing = _rules.warn_while_tracing


class SyncBatchNorm(LayerMixin, _BatchNorm):
    """Batch normalization whose training statistics span every rank of a process group.

    A drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU (any ``torch.distributed`` backend: gloo,
    NCCL, MPI) and is exactly ``nn.BatchNorm`` without an initialised process group or in a group of one.

    In training, mean and variance are computed per channel over the concatenation of every rank's batch
    (uneven and empty per-rank batches included):

    .. math::
        y = \\frac{x - \\mathrm{E}[x]}{\\sqrt{\\mathrm{Var}[x] + \\epsilon}} * \\gamma + \\beta

    One ``all_reduce`` of :math:`O(C)` float64 values each way, whatever the world size, and no device-to-host
    synchronisation on GPU. The running variance is updated with the unbiased global variance; the gradients
    of :math:`\\gamma` and :math:`\\beta` stay local (DDP sums them). Eval never communicates: it uses the
    running statistics or, with ``track_running_stats=False``, the local batch's (as
    ``torch.nn.SyncBatchNorm``).

    Args:
        num_features: number of channels :math:`C` of an input :math:`(N, C, *)`.
        eps: value added to the variance for numerical stability. Default: 1e-5.
        momentum: running-statistics update factor, or ``None`` for a cumulative moving average. Default: 0.1.
        affine: learnable per-channel :math:`\\gamma` and :math:`\\beta`. Default: ``True``.
        track_running_stats: keep running mean and variance for eval. Default: ``True``.
        process_group: ``torch.distributed`` group whose ranks share statistics, or a
            ``DeviceMesh`` (a 1-D mesh: its group; a multi-dimensional one: all its ranks);
            ``None`` is the default group, looked up at call time.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        bias: with ``affine=True``, learn :math:`\\beta` too (``False``: scale only,
            as ``nn.BatchNorm``'s ``bias=False`` in torch 2.13). Default: ``True``.
        freeze: normalise with the running statistics in training too, never update them, give :math:`\\gamma`
            and :math:`\\beta` no gradient and never communicate (the input still gets its gradient).
            ``freeze=True`` here also sets ``requires_grad=False`` on them (torch's way of freezing: DDP then
            expects no gradient for them); a later change of ``freeze`` leaves it. Default: ``False``.

    Shape:
        - Input: :math:`(N, C, *)`, at least 2 dimensions.
        - Output: same shape, dtype and memory format as the input.

    Example::

        >>> import torch, syncbn
        >>> bn = syncbn.SyncBatchNorm(16)
        >>> y = bn(torch.randn(8, 16, 10, 10))   # plain BatchNorm outside torch.distributed
        >>> # under torchrun: torch.distributed.init_process_group("gloo"), then the
        >>> # same call normalises over every rank's batch together.
    """

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
        bias: bool = True,
        freeze: bool = False,
    ) -> None:
        if freeze and not track_running_stats:
            raise ValueError(
                "freeze=True normalises with the running statistics, so it needs "
                "track_running_stats=True (got track_running_stats=False)"
            )
        drop_bias = affine and not bias
        extra = {"bias": False} if drop_bias and _BATCHNORM_TAKES_BIAS else {}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra
        )
        if drop_bias and not _BATCHNORM_TAKES_BIAS:  # torch < 2.13: what its BatchNorm(bias=False) does
            self.register_parameter("bias", None)
        self.process_group = process_group
        self.freeze = freeze
        if freeze:  # no gradient: DDP must not wait for one (find_unused_parameters)
            for parameter in (self.weight, self.bias):
                if parameter is not None:
                    parameter.requires_grad_(False)
        self._init_state()

    def _check_input_dim(self, input: Tensor) -> None:
        check_input(input, self.num_features, dims=self._input_dims, dims_text=self._input_dims_text)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalise ``input``; with ``mask``, over its valid positions only.

        Args:
            input: :math:`(N, C, *)` tensor.
            mask: optional boolean :math:`(N, *)` tensor, ``True`` at valid positions: statistics are those of
                every rank's valid positions together; padded positions get output 0 and gradient 0. See
                :func:`syncbn.functional.sync_batch_norm`.

        Returns:
            The normalised tensor, same shape and dtype as ``input``.
        """
        if isinstance(input, torch.fx.Proxy):  # torch.fx tracing: a leaf, as torch.nn's layers
            return _fx.leaf_call(self, SyncBatchNorm.forward, *((input,) if mask is None else (input, mask)))
        self._check_input_dim(input)
        if mask is None:
            return self._normalize(input)
        if _is_compiling():
            _warn_while_tracing(
                f"syncbn: {type(self).__name__}({self.num_features}) called with a mask under "
                "torch.compile: selecting the valid positions has a data-dependent shape, so "
                "dynamo breaks the graph at this layer (the layer itself still runs exactly)"
            )
        # The valid positions as an (M, C, 1, ...) batch; a subclass's own forward (timm's
        # activation, say) runs once, on the scattered result.
        return apply_masked(self._normalize, input, mask)

    def _normalize(self, input: Tensor) -> Tensor:
        """Normalise a checked ``input``: eval or frozen (never communicates), or one training call."""
        if self.freeze or not self.training:  # the running statistics, or in eval without them the batch's
            weight: Tensor | None = self.weight
            bias: Tensor | None = self.bias
            mean = self.running_mean
            if self.freeze:  # (no gradient for weight and bias)
                weight, bias = (None if t is None else t.detach() for t in (weight, bias))
            weight, bias = _rules.affine_for_statistics(mean, weight, bias)
            batch = not self.freeze and mean is None
            return F.batch_norm(input, mean, self.running_var, weight, bias, batch, 0.0, self.eps)
        check_eps(self.eps)
        replica = self.__dict__.get("_syncbn_replica")
        if replica is not None:  # an nn.DataParallel replica (syncbn.parallel)
            call = self._training_call()
            family = self._replica_family(replica.replication, replica.index, input)
            return replica.forward(self, input, call, family)  # type: ignore[no-any-return]
        compiling = _is_compiling()
        if compiling and _ops is not None:
            return self._compiled_training_forward(input)
        if compiling:
            _warn_while_tracing(
                f"syncbn: {type(self).__name__}({self.num_features}) under torch.compile: torch "
                f"{torch.__version__} has no ordered effectful custom operators, so the synchronised "
                "layer runs eagerly and dynamo breaks the graph at every syncbn layer"
            )
        call = self._training_call(_rules.in_backward())  # (no replica, not compiling: checked above)
        group = groups.resolve(self._group())
        family = self._family_call(call.recomputing, True)
        weight, bias = _rules.affine_for_statistics(call.running_mean, self.weight, self.bias)
        if group is None and family is BATCH_NORM and not call.pooled:  # exactly nn.BatchNorm
            return call.batch_norm(input, weight, bias, self.eps)
        params = call.params(self.eps, LOCAL if group is None else group, self, family)
        return call.counted(apply(input, weight, bias, params))

    def _compiled_training_forward(self, input: Tensor) -> Tensor:
        # Traced arithmetic around the opaque collective; the layer travels as its token (no guard on it).
        handle = _ops.group_handle(self.process_group)
        if handle and _ops.tracing_a_checkpointed_region():
            _warn_while_tracing(
                f"syncbn: {type(self).__name__}({self.num_features}) inside torch.utils.checkpoint "
                "under torch.compile: torch's AOTAutograd cannot recompute syncbn's collective "
                "operator in a checkpointed region, so dynamo breaks the graph there and runs "
                "the checkpointed region eagerly (statistics synchronised and updated once)"
            )
            torch._dynamo.graph_break()
        call = self._training_call(False, traced=bool(handle))  # over a group: momentum=None a tensor
        weight, bias = _rules.affine_for_statistics(call.running_mean, self.weight, self.bias)
        family = self._family_call().snapshot(_ops.snapshot)  # (what the traced running update changes)
        if not handle and family is BATCH_NORM and not call.pooled:
            return call.batch_norm(input, weight, bias, self.eps)
        params = call.params(self.eps, handle, _ops.layer_token(self) if handle else None, family)
        return call.counted(_compiled.sync_batch_norm(input, weight, bias, params))

    def _family_call(self, recomputing: bool = False, eager: bool = False) -> Any:
        """This call's family object (:mod:`syncbn.families`), batch norm's here (``eager``: not traced)."""
        return BATCH_NORM

    def _replica_family(self, replication: Any, rank: int, input: Tensor) -> Any:
        """Replica ``rank``'s family; replica 0 has the user's layer keep what a recomputation reads."""
        if replication.recomputing:  # (the forward's statistics, on the input's device)
            return self._family_call(True).snapshot(lambda t: t.to(input.device))
        if rank == 0:
            replication.master._family_call(False, True)
        return self._family_call()

    def _replicate_for_data_parallel(self) -> SyncBatchNorm:
        replica: SyncBatchNorm = super()._replicate_for_data_parallel()
        parallel.attach_replica(self, replica)  # the replicas of this layer synchronise with each other
        return replica

    def reset_parameters(self) -> None:
        if self.weight is not None and self.bias is None and not _BATCHNORM_TAKES_BIAS:
            # torch < 2.13's reset_parameters assumes a bias whenever affine=True.
            self.reset_running_stats()
            torch.nn.init.ones_(self.weight)
            return
        super().reset_parameters()

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text + ", freeze=True" if self.freeze else text

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """Same as :func:`syncbn.convert_sync_batchnorm` (the ``torch.nn.SyncBatchNorm`` spelling).

        Example::

            >>> model = syncbn.SyncBatchNorm.convert_sync_batchnorm(model)
        """
        if _converter is None:
            raise RuntimeError("syncbn.convert is not imported (import syncbn, not syncbn.modules alone)")
        return _converter(module, process_group)


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    __doc__ = dims_doc(
        "SyncBatchNorm",
        "for 2D input ``(N, C)`` or 3D input ``(N, C, L)``",
        ":math:`(N, C)` or :math:`(N, C, L)`",
        "same as input.",
        "bn = syncbn.SyncBatchNorm1d(32)\ny = bn(torch.randn(20, 32))",
        "nn.BatchNorm1d",
    )

    _input_dims = (2, 3)
    _input_dims_text = "2D or 3D"


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    __doc__ = dims_doc(
        "SyncBatchNorm",
        "for 4D input ``(N, C, H, W)``",
        ":math:`(N, C, H, W)`",
        "same as input (``channels_last`` is kept).",
        "bn = syncbn.SyncBatchNorm2d(64)\ny = bn(torch.randn(8, 64, 32, 32))",
        "nn.BatchNorm2d",
    )

    _input_dims = (4,)
    _input_dims_text = "4D"


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    __doc__ = dims_doc(
        "SyncBatchNorm",
        "for 5D input ``(N, C, D, H, W)``",
        ":math:`(N, C, D, H, W)`",
        "same as input (``channels_last_3d`` is kept).",
        "bn = syncbn.SyncBatchNorm3d(16)\ny = bn(torch.randn(2, 16, 4, 8, 8))",
        "nn.BatchNorm3d",
    )

    _input_dims = (5,)
    _input_dims_text = "5D"
