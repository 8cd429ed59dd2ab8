"""The layer machinery of the in-place activated layers, shared with :mod:`syncbn.compat.inplace_abn`."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from . import _fx, groups, parallel
from ._errors import ChannelCountError
from ._layer import LayerMixin, TrainingCall
from .engine import _rules
from .engine._rules import is_compiling, warn_while_tracing
from .families.inplace_abn import InPlaceABN, check_activation, check_writable
from .functional import check_eps, inplace_abn_apply

try:
    from .engine import _ops
    from .engine._compiled import traced_inplace_abn
except ImportError:  # torch without ordered effectful custom operators: compiled models run eagerly
    _ops = None  # type: ignore[assignment]

__all__ = ["ActivatedBatchNormBase"]


# Tensors an in-place layer wrote over (not recomputing): id -> (weak reference, version after the write).
_written: dict[int, tuple[weakref.ref[Tensor], int]] = {}


def _remember(y: Tensor) -> None:
    if y.is_inference():  # no version counter, and never recomputed by a checkpoint
        return
    key = id(y)

    def forget(_: Any, key: int = key) -> None:
        _written.pop(key, None)

    try:
        _written[key] = (weakref.ref(y, forget), y._version)
    except TypeError:  # a tensor subclass without weak references
        pass


def _was_overwritten(x: Tensor) -> bool:
    hit = _written.get(id(x))
    return hit is not None and hit[0]() is x and hit[1] == x._version


OVERWRITTEN_CHECKPOINT_INPUT = (
    "syncbn: activation checkpointing recomputes an in-place activated batch norm from its input, but "
    "that input is the tensor the layer overwrote in the first forward (the checkpointed function's "
    "own input, or a tensor from outside the region): the recomputation would read the layer's output "
    "instead. Start the checkpointed region with the operation that produces the layer's input (e.g. "
    "the convolution before it), or use a non-in-place layer there."
)


class ActivatedBatchNormBase(LayerMixin):
    """State and forward machinery of the activated batch norm layers (not used directly).

    Subclasses set ``_in_place`` and ``_group_attr`` (``None``: no group); the scale is ``|weight| + eps``.
    """

    _version = 2
    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    _in_place = True
    _group_attr: str | None = None
    _local = False  # never synchronise (the package's InPlaceABN)

    def __init__(
        self,
        num_features: int,
        eps: float,
        momentum: float | None,
        affine: bool,
        track_running_stats: bool,
        activation: str,
        activation_param: float,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_activation(activation, activation_param, in_place=self._in_place)
        super().__init__()
        self.num_features, self.eps, self.momentum, self.affine = num_features, eps, momentum, affine
        self.track_running_stats = tracked = track_running_stats
        self.activation, self.activation_param = activation, activation_param
        for name in ("weight", "bias"):  # the parameters and buffers of nn.BatchNorm, in its order
            self.register_parameter(
                name, nn.Parameter(torch.empty(num_features, device=device, dtype=dtype)) if affine else None
            )
        for name, fill in (("running_mean", torch.zeros), ("running_var", torch.ones)):
            self.register_buffer(name, fill(num_features, device=device, dtype=dtype) if tracked else None)
        count = torch.tensor(0, dtype=torch.long, device=device) if tracked else None
        self.register_buffer("num_batches_tracked", count)
        self._init_state()  # the compile token finds this layer
        self.reset_parameters()  # type: ignore[misc]
        _make_opaque()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _make_opaque()

    # nn.BatchNorm's own: running mean 0, variance 1, num_batches_tracked 0; weight 1, bias 0.
    reset_running_stats = _NormBase.reset_running_stats
    reset_parameters = _NormBase.reset_parameters

    def forward(self, x: Tensor) -> Tensor:
        """Normalise and activate ``x`` in place (over the layer's group, if any).

        Args:
            x: :math:`(N, C, *)` tensor, overwritten.

        Returns:
            ``x``, holding the output.
        """
        if isinstance(x, torch.fx.Proxy):  # torch.fx tracing: a leaf, as torch.nn's layers
            return _fx.leaf_call(self, ActivatedBatchNormBase.forward, x)
        self._check_activation()
        if self.training:
            check_eps(self.eps)
        if is_compiling():  # traced, unless dynamo must run this layer or region eagerly
            if _ops is None or (
                not self._local
                and self.training
                and _ops.group_handle(self._group())
                and _ops.tracing_a_checkpointed_region()  # (AOTAutograd cannot recompute the collective)
            ):
                where = f"on torch {torch.__version__}" if _ops is None else "inside torch.utils.checkpoint"
                warn_while_tracing(
                    f"syncbn: {type(self).__name__}({self.num_features}) under torch.compile {where}: "
                    "dynamo breaks the graph here and runs the layer eagerly"
                )
                torch._dynamo.graph_break()
            else:
                return self._compiled_forward(x)
        return self._eager_forward(x)

    _repr_tracking = True  # show track_running_stats (the inplace-abn package's ABN does not)

    def extra_repr(self) -> str:
        text = f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
        if self._repr_tracking:
            text += f"track_running_stats={self.track_running_stats}, "
        text += f"activation={self.activation}"
        if self.activation in ("leaky_relu", "elu"):
            text += f"[{self.activation_param}]"
        return text

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2 or (self._input_dims is not None and x.dim() not in self._input_dims):
            expected = self._input_dims_text or "at least 2D"
            raise ValueError(f"expected {expected} input (got {x.dim()}D input)")
        if x.shape[1] != self.num_features:
            raise ChannelCountError(
                f"expected input with {self.num_features} channels in dimension 1 "
                f"(got input of size {list(x.shape)})"
            )

    def _check_activation(self) -> None:
        # At every call, as at construction: activation and activation_param are plain attributes.
        check_activation(self.activation, self.activation_param, in_place=self._in_place)

    def _compiled_forward(self, x: Tensor) -> Tensor:
        if self.__dict__.get("_syncbn_replica") is not None:  # (replicas run eagerly)
            return _eager_forward(self, x)
        if self.training and x._base is not None:  # a view: autograd refuses the traced Function's outputs
            warn_while_tracing(
                f"syncbn: {type(self).__name__}({self.num_features}) under torch.compile on an input "
                "that is a view of another tensor: dynamo breaks the graph here and runs the layer "
                "eagerly (pass a tensor that is not a view, e.g. the output of the operation before "
                "it or a .contiguous() copy, to keep the layer in the graph)"
            )
            return _eager_forward(self, x)
        self._check_input_dim(x)
        check_writable(x, "in-place activated batch norm")  # (while tracing: the eager path's error)
        handle = 0 if self._local or not self.training else _ops.group_handle(self._group())
        if self.training:
            call = self._training_call(False, traced=True)
        else:  # the running statistics, never updated, or without them the batch's
            call = TrainingCall(self.running_mean, self.running_var, 0.0, None, False)
        token = _ops.layer_token(self) if handle else None
        batch = self.training or call.running_mean is None
        family = InPlaceABN(self.activation, float(self.activation_param), batch)
        weight, bias = _rules.affine_for_statistics(self.running_mean, self.weight, self.bias)
        out = traced_inplace_abn(x, weight, bias, call.params(self.eps, handle, token, family))
        return call.counted(out)

    def _eager_forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        act, param = self.activation, float(self.activation_param)
        weight, bias = _rules.affine_for_statistics(self.running_mean, self.weight, self.bias)
        if not self.training:  # no communication: the running statistics, or without them the batch's
            mean, var, eps = self.running_mean, self.running_var, self.eps
            return inplace_abn_apply(x, weight, bias, mean, var, mean is None, 0.0, eps, act, param, None)
        call = self._training_call()
        if call.recomputing and (_was_overwritten(x) or (x.is_leaf and x.requires_grad)):  # (leaf: copied in)
            raise RuntimeError(OVERWRITTEN_CHECKPOINT_INPUT)
        replica = self.__dict__.get("_syncbn_replica")
        if replica is not None:
            out = replica.forward(self, x, call, InPlaceABN(act, param))
        else:
            group = None if self._local else groups.resolve(self._group())
            stats = (*call.updated(), True, call.momentum, self.eps, act, param, group, self, call.statistics)
            out = call.counted(inplace_abn_apply(x, weight, bias, *stats))
        if not call.recomputing:
            _remember(out)
        return out

    def _replicate_for_data_parallel(self) -> ActivatedBatchNormBase:
        replica: ActivatedBatchNormBase = super()._replicate_for_data_parallel()
        if not self._local:  # the replicas of a synchronised layer synchronise with each other
            parallel.attach_replica(self, replica)
        return replica

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
    ) -> None:
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and self.track_running_stats and key not in state_dict:
            # Version-1 checkpoints (inplace-abn < 1.0, torch < 0.4.1) have no num_batches_tracked.
            state_dict[key] = torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


# What torch.compile runs for the in-place layers: the eager layer, opaque to the compiler. Made by the
# first layer's construction or unpickling, not at import: importing dynamo costs every process ~1.5 s.
_eager_forward: Any = None


def _make_opaque() -> None:
    global _eager_forward
    if _eager_forward is None:
        _eager_forward = torch._dynamo.disable(ActivatedBatchNormBase._eager_forward)
