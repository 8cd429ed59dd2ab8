"""In-place activated synchronised batch norm as layers: :class:`InPlaceSyncBatchNorm` and its 2d form.

The layer machinery shared with :mod:`syncbn.compat.inplace_abn` lives in
:class:`ActivatedBatchNormBase`: parameters and buffers with ``nn.BatchNorm``'s
names, torch's momentum convention (``None``: cumulative average), training
and eval, ``nn.DataParallel`` replicas (:mod:`syncbn.parallel._abn`),
activation checkpointing, checkpoint loading, pickling with a process group.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import _abn, _abn_math, _checks, _ops, groups, parallel
from ._abn_traced import traced_inplace_abn
from .parallel._abn import replica_inplace_abn

__all__ = ["ActivatedBatchNormBase", "InPlaceSyncBatchNorm", "InPlaceSyncBatchNorm2d"]

_current_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_is_compiling: Callable[[], bool] = (
    getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
)

# Tensors an in-place layer wrote over outside a recomputation: id -> (weak reference, version after
# the write). A checkpointed region whose recomputation hands a layer one of these (unchanged since)
# would recompute from overwritten values: that is refused (see ActivatedBatchNormBase._forward).
_written: dict[int, tuple[weakref.ref[Tensor], int]] = {}


def _remember(y: Tensor) -> None:
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


class ActivatedBatchNormBase(nn.Module):
    """State and forward machinery of the activated batch norm layers (not used directly).

    Subclasses set ``_in_place`` and implement :meth:`_group` (what to synchronise
    over). ``weight`` is used as the scale ``|weight| + eps`` by the in-place
    layers (invertible whatever the weight's sign).
    """

    _version = 2
    num_features: int
    eps: float
    momentum: float | None
    affine: bool
    track_running_stats: bool
    activation: str
    activation_param: float
    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    _in_place = True
    _local = False  # never synchronise (the package's InPlaceABN)
    _input_dims: tuple[int, ...] | None = None
    _input_dims_text = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _abn_math.check_activation(activation, activation_param, in_place=self._in_place)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.activation = activation
        self.activation_param = activation_param
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **factory))
            self.bias = nn.Parameter(torch.empty(num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self._syncbn_state = _checks.LayerState()
        self._syncbn_state.bind(self)  # the compile token finds this layer
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        """Running mean 0, running variance 1, ``num_batches_tracked`` 0."""
        if self.track_running_stats:
            self.running_mean.zero_()  # type: ignore[union-attr]
            self.running_var.fill_(1)  # type: ignore[union-attr]
            self.num_batches_tracked.zero_()  # type: ignore[union-attr,operator]

    def reset_parameters(self) -> None:
        """Reset the running statistics; weight 1 and bias 0."""
        self.reset_running_stats()
        if self.weight is not None and self.bias is not None:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _group(self) -> Any:
        return None

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2 or (self._input_dims is not None and x.dim() not in self._input_dims):
            expected = self._input_dims_text or "at least 2D"
            raise ValueError(f"expected {expected} input (got {x.dim()}D input)")
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"expected input with {self.num_features} channels in dimension 1 "
                f"(got input of size {list(x.shape)})"
            )

    def _factor(self, tracking: bool, recomputing: bool) -> float:
        if recomputing:
            return 0.0
        if self.momentum is None:
            seen = self.num_batches_tracked
            return 1.0 / (float(seen.item()) + 1.0) if tracking and seen is not None else 0.0
        return float(self.momentum)

    def _forward(self, x: Tensor) -> Tensor:
        """Training or eval forward of the in-place layers; returns ``x``, overwritten.

        Under ``torch.compile`` the traced form (:mod:`syncbn._abn_traced`): no
        graph break, the collectives the one opaque operator of :mod:`syncbn._ops`.
        """
        if _is_compiling():
            return self._compiled_forward(x)
        return self._eager_forward(x)

    def _compiled_forward(self, x: Tensor) -> Tensor:
        # Traced, no graph break: only the collective is opaque (syncbn::all_reduce_sum, see
        # syncbn._abn_traced); nothing guards on which layer this is (the layer is its token).
        # nn.DataParallel replicas run eagerly (one graph break per layer).
        if self.__dict__.get("_syncbn_replica") is not None:
            return _eager_forward(self, x)
        self._check_input_dim(x)
        handle = 0 if self._local or not self.training else _ops.group_handle(self._group())
        tracking = self.training and self.track_running_stats
        factor: float | Tensor = 0.0
        if tracking:
            seen = self.num_batches_tracked
            if self.momentum is None and seen is not None:
                factor = 1.0 / (seen + 1).to(torch.float64)
            else:
                factor = 0.0 if self.momentum is None else float(self.momentum)
        act, param = self.activation, float(self.activation_param)
        running = self.training is False and self.running_mean is not None
        mean = self.running_mean if (tracking or running) else None
        var = self.running_var if (tracking or running) else None
        out = traced_inplace_abn(
            x,
            self.weight,
            self.bias,
            mean,
            var,
            not running,
            factor,
            self.eps,
            act,
            param,
            handle,
            _ops.layer_token(self) if handle else None,
        )
        if tracking and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return out

    def _eager_forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        recomputing = self.training and _current_graph_task_id() != -1
        tracking = self.training and self.track_running_stats and not recomputing
        factor = self._factor(tracking, recomputing)
        if recomputing and (_was_overwritten(x) or (x.is_leaf and x.requires_grad)):
            # (a reentrant checkpoint hands its region detached copies of its inputs: leaves)
            raise RuntimeError(OVERWRITTEN_CHECKPOINT_INPUT)
        act, param = self.activation, float(self.activation_param)
        if not self.training and self.running_mean is not None:
            out = _abn.inplace_abn_apply(
                x,
                self.weight,
                self.bias,
                self.running_mean,
                self.running_var,
                False,
                0.0,
                self.eps,
                act,
                param,
                None,
            )
            return out
        if not self.training:  # eval without running statistics: the local batch's, no communication
            return _abn.inplace_abn_apply(
                x, self.weight, self.bias, None, None, True, 0.0, self.eps, act, param, None
            )
        replica = self.__dict__.get("_syncbn_replica")
        if replica is not None:
            out = replica_inplace_abn(self, x, factor, replica.replication, replica.index, act, param)
        else:
            group = None if self._local else groups.resolve(self._group())
            running_mean = self.running_mean if self.track_running_stats else None
            running_var = self.running_var if self.track_running_stats else None
            out = _abn.inplace_abn_apply(
                x,
                self.weight,
                self.bias,
                running_mean,
                running_var,
                True,
                factor,
                self.eps,
                act,
                param,
                group,
                self,
            )
            if tracking and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
        if not recomputing:
            _remember(out)
        return out

    def _replicate_for_data_parallel(self) -> ActivatedBatchNormBase:
        replica: ActivatedBatchNormBase = super()._replicate_for_data_parallel()
        if not self._local:  # the replicas of a synchronised layer synchronise with each other
            parallel.attach_replica(self, replica)
        return replica

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and self.track_running_stats and key not in state_dict:
            # Version-1 checkpoints (inplace-abn < 1.0, BatchNorm before torch 0.4.1) have no
            # num_batches_tracked: it starts at 0, as the package and nn.BatchNorm do.
            state_dict[key] = torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("process_group", "group"):
            if key in state:
                state[key] = groups.to_picklable(state[key])
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> ActivatedBatchNormBase:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            shared = key in ("process_group", "group")  # a live process group is shared, not copied
            new.__dict__[key] = value if shared else copy.deepcopy(value, memo)
        new._syncbn_state.bind(new)
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._syncbn_state.bind(self)


# What torch.compile runs for the in-place layers: the eager layer, opaque to the compiler.
_eager_forward = torch._dynamo.disable(ActivatedBatchNormBase._eager_forward)


class InPlaceSyncBatchNorm(ActivatedBatchNormBase):
    """Synchronised batch norm and an invertible activation as one in-place operation.

    .. math::
        y = \\phi\\Big(\\frac{x - \\mathrm{E}[x]}{\\sqrt{\\mathrm{Var}[x] + \\epsilon}}
            \\,(|\\gamma| + \\epsilon) + \\beta\\Big)

    written over the input and returned; backward keeps only :math:`y` (and
    per-channel vectors) and recovers the normalised input by inverting
    :math:`\\phi` and the affine map: about half the activation memory of
    ``SyncBatchNorm`` followed by an activation. Statistics span the
    ``process_group`` exactly as :class:`syncbn.SyncBatchNorm`'s (one collective
    each way, uneven and empty batches); a group of one or no process group is
    the local layer; ``nn.DataParallel`` replicas synchronise with each other.

    Weight convention: the scale is :math:`|\\gamma| + \\epsilon` (as InPlace-ABN),
    so it never reaches 0 and the inversion always exists.
    :func:`syncbn.fuse_batchnorm_activation` converts a trained
    ``BatchNorm`` + ``LeakyReLU``/``ELU`` pair (setting :math:`\\gamma - \\epsilon`);
    :func:`syncbn.revert_sync_batchnorm` turns the layer back into
    ``nn.Sequential(BatchNorm(weight = |γ| + ε), activation)``.

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

    def _group(self) -> Any:
        group = self.process_group
        if isinstance(group, groups.ProcessGroupRef) and groups.is_initialized():
            self.process_group = group = group.lookup()
        return group

    def forward(self, input: Tensor) -> Tensor:
        """Normalise and activate ``input`` in place; returns it.

        Args:
            input: :math:`(N, C, *)` tensor, overwritten.

        Returns:
            ``input``, holding the output.
        """
        return self._forward(input)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, activation={self.activation}"
        )
        if self.activation in ("leaky_relu", "elu"):
            text += f"[{self.activation_param}]"
        return text


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

    Args:
        layer: an in-place activated layer.
        generic: the plain batch norm class for input of any rank (``syncbn.convert.BatchNorm``,
            handed down by :mod:`syncbn.convert`), used unless the layer checks for 4D input.

    Returns:
        The pair, with the layer's statistics, mode, device and dtype; the weight is a new
        ``Parameter`` holding ``|w| + eps`` (the bias is the layer's own).
    """
    cls = nn.BatchNorm2d if layer._input_dims == (4,) else generic
    ref = layer.weight if layer.weight is not None else layer.running_mean
    bn: Any = cls(  # type: ignore[call-arg]
        layer.num_features,
        layer.eps,
        layer.momentum,
        layer.affine,
        layer.track_running_stats,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
    )
    with torch.no_grad():
        if layer.weight is not None:
            bn.weight = nn.Parameter(layer.weight.abs() + layer.eps, requires_grad=layer.weight.requires_grad)
            bn.bias = layer.bias
        if layer.running_mean is not None:
            bn.running_mean, bn.running_var = layer.running_mean, layer.running_var
            bn.num_batches_tracked = layer.num_batches_tracked
    bn.train(layer.training)
    pair = nn.Sequential(bn, activation_module(layer.activation, float(layer.activation_param)))
    pair.train(layer.training)
    return pair
