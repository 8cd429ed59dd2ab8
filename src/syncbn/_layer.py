"""What every syncbn layer class shares (:class:`LayerMixin`, first base of each), and small helpers."""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from . import _checks, groups

__all__ = ["LayerMixin", "check_module", "dims_doc", "like"]


class LayerMixin(nn.Module):
    """The group attribute, the layer state (name, handshake, compile token), copy and pickle."""

    _group_attr: str | None = "process_group"  # the attribute holding the group (None: never synchronises)
    momentum: float | None
    num_batches_tracked: Tensor | None
    _input_dims: tuple[int, ...] | None = None  # the accepted input ranks (None: any of at least 2)
    _input_dims_text = ""  # how they read in an error, e.g. "2D or 3D"

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

    def _factor(self, tracking: bool, recomputing: bool) -> float:
        """This training call's running-statistics factor: 0 when recomputing (checkpointing).

        ``momentum=None`` is nn.BatchNorm's cumulative average: 1 / (batches seen, this one included).
        """
        if recomputing:
            return 0.0
        if self.momentum is None:
            seen = self.num_batches_tracked
            return 1.0 / (float(seen.item()) + 1.0) if tracking and seen is not None else 0.0
        return float(self.momentum)

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


def dims_doc(
    base: str, rank: str, shape: str, output: str, example: str, plain: str = "", args: str = ""
) -> str:
    """The docstring of the class of ``base`` for one input rank.

    ``example``: the constructor and the call, on two lines; ``plain``: the ``nn.BatchNorm*d``
    it is an instance of; ``args``: an ``Args:`` section, placed before ``Shape:``.
    """
    text = f":class:`{base}` {rank}."
    if plain:
        text += (
            f"\n\nSame arguments and math as :class:`{base}`; checks the input rank\nlike ``{plain}``, "
            f"and is an ``{plain}``: ``isinstance(layer,\n{plain})`` is true, so code that finds "
            "BatchNorm layers by type (freezing,\nweight-decay exclusion, initialisation loops) finds it too."
        )
    construct, call = example.split("\n")
    return (
        f"{text}\n\n{args}Shape:\n    - Input: {shape}\n    - Output: {output}\n\n"
        f"Example::\n\n    >>> {construct}\n    >>> {call}\n"
    )
