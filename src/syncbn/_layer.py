"""What every syncbn layer class shares (:class:`LayerMixin`, first base of each), and small helpers."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks, _cmbn, groups
from .engine import _rules
from .engine._function import Params

__all__ = ["LayerMixin", "TrainingCall", "check_module", "dims_doc", "like", "training_call"]

_T = TypeVar("_T")


class TrainingCall(NamedTuple):
    """One training call's bookkeeping, made once by :func:`training_call` (docs/architecture.md)."""

    running_mean: Tensor | None  # the layer's, updated in place unless pooled (None: tracks none)
    running_var: Tensor | None
    momentum: Any  # the update factor, a float (traced, momentum=None: a 0-dim float64 tensor)
    counter: Tensor | None  # num_batches_tracked, when this call counts its batch
    recomputing: bool  # a checkpoint's recomputation (activation checkpointing, in backward)
    statistics: Any = _cmbn.THIS_CALL  # what it normalises with (a CmBN block's: syncbn._cmbn.Pool)

    @property
    def pooled(self) -> bool:
        """Whether a CmBN block pools this call (the block updates the running statistics at its end)."""
        return self.statistics is not _cmbn.THIS_CALL

    def updated(self) -> tuple[Tensor | None, Tensor | None]:
        """The running statistics this call updates: none when pooled."""
        return (self.running_mean, self.running_var) if self.statistics is _cmbn.THIS_CALL else (None, None)

    def params(self, eps: float, group: Any, layer: Any, family: Any) -> Params:
        """The engine's :class:`~syncbn.engine._function.Params` of this call with ``family``."""
        return Params(*self.updated(), eps, self.momentum, group, layer, family, self.statistics)

    def batch_norm(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        """``nn.BatchNorm``'s own training kernel on a call of its own statistics, its batch counted."""
        out = F.batch_norm(x, self.running_mean, self.running_var, weight, bias, True, self.momentum, eps)
        return self.counted(out)

    def counted(self, out: _T) -> _T:
        """Count this call's batch in ``num_batches_tracked`` (the one increment); returns ``out``."""
        if self.counter is not None:
            self.counter.add_(1)
        return out


def training_call(layer: Any, recomputing: bool | None = None, traced: bool = False) -> TrainingCall:
    """The bookkeeping of a training call of ``layer`` (``recomputing`` ``None``: detected).

    The factor is ``momentum``, 0 when recomputing; ``momentum=None``: 1 / (batches seen, this one
    included), with ``traced`` a tensor (no host read, no recompilation per step).
    """
    if recomputing is None:
        replica = layer.__dict__.get("_syncbn_replica")
        recomputing = (replica is not None and replica.replication.recomputing) or (
            not _rules.is_compiling() and _rules.in_backward()
        )
    tracked = bool(layer.track_running_stats)
    counter = layer.num_batches_tracked if tracked and not recomputing else None
    momentum: Any = 0.0 if recomputing or layer.momentum is None else float(layer.momentum)
    if layer.momentum is None and counter is not None:
        momentum = 1.0 / ((counter.to(torch.float64) if traced else float(counter.item())) + 1.0)
    mean, var = (layer.running_mean, layer.running_var) if tracked else (None, None)
    return TrainingCall(mean, var, momentum, counter, recomputing, _cmbn.statistics(layer, recomputing))


class LayerMixin(nn.Module):
    """The group attribute, the layer state (name, handshake, compile token), copy and pickle."""

    _group_attr: str | None = "process_group"  # the attribute holding the group (None: never synchronises)
    momentum: float | None
    num_batches_tracked: Tensor | None
    _input_dims: tuple[int, ...] | None = None  # the accepted input ranks (None: any of at least 2)
    _input_dims_text = ""  # how they read in an error, e.g. "2D or 3D"
    _training_call = training_call  # this training call's bookkeeping, made once per call

    def _init_state(self) -> None:
        self._syncbn_state = _checks.LayerState()
        self._syncbn_state.bind(self)

    def _group(self) -> Any:
        """The layer's process group (``None``: the default group), a pickled reference looked up."""
        if self._group_attr is None:
            return None
        group = getattr(self, self._group_attr, None)
        if isinstance(group, groups.ProcessGroupRef) and groups.is_initialized():
            group = group.lookup()
            setattr(self, self._group_attr, group)
        return group

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        key = self._group_attr
        if key is not None and key in state:
            state[key] = groups.to_picklable(state[key])
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            # A process group is a handle to live communicators: share it.
            new.__dict__[key] = value if key == self._group_attr else copy.deepcopy(value, memo)
        _checks.bind_state(new)
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _checks.bind_state(self)


def check_module(module: Any, function: str) -> None:
    """Raise ``TypeError`` unless ``module`` is an ``nn.Module`` (``function`` names the caller)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{function} expected a torch.nn.Module (got {type(module).__name__})")


def like(cls: type[Any], layer: Any, **kwargs: Any) -> Any:
    """A ``cls`` layer built with ``layer``'s arguments ``num_features`` to ``track_running_stats``."""
    return cls(
        layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats, **kwargs
    )


def dims_doc(base: str, rank: str, shape: str, output: str, example: str, plain: str) -> str:
    """The docstring of ``base``'s class for one input rank (an ``nn.BatchNorm*d``: ``plain``); ``example``:
    its constructor and call, on two lines."""
    text = (
        f":class:`{base}` {rank}.\n\nSame arguments and math as :class:`{base}`; checks the input rank\nlike "
        f"``{plain}``, and is an ``{plain}``: ``isinstance(layer,\n{plain})`` is true, so code that finds "
        "BatchNorm layers by type (freezing,\nweight-decay exclusion, initialisation loops) finds it too."
    )
    construct, call = example.split("\n")
    return (
        f"{text}\n\nShape:\n    - Input: {shape}\n    - Output: {output}\n\n"
        f"Example::\n\n    >>> {construct}\n    >>> {call}\n"
    )
