"""The engine's dtype rules and its "one value per channel" error, for every family and path."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _checks, _math

__all__ = ["gradient_dtype", "one_value_error", "statistics_dtype"]


def statistics_dtype(x: Tensor, weight: Tensor | None, running_mean: Tensor | None) -> torch.dtype:
    """The dtype normalisation statistics are handed to the native kernels in.

    The layer's parameter dtype when it has parameters or buffers (so a float32
    layer fed float16 input keeps float32 statistics), else float32 or float64
    after the input.
    """
    if weight is not None:
        return weight.dtype
    if running_mean is not None:
        return running_mean.dtype
    return _math.accumulation_dtype(x.dtype)


def gradient_dtype(weight: Tensor | None, bias: Tensor | None, mean: Tensor) -> torch.dtype:
    """The dtype of the weight and bias gradients: the parameters', else the statistics' (``mean``)."""
    if weight is not None:
        return weight.dtype
    return bias.dtype if bias is not None else mean.dtype


def one_value_error(
    x: Tensor, size: int, members: str, layer: Any = None, who: str = "this rank's"
) -> ValueError:
    """The error of a training call whose global count is one, in every family's and path's words.

    Args:
        x: this member's input.
        size: the number of members of the group.
        members: what they are ("ranks of the group", "replicas of ...").
        layer: the calling layer (named in the message), or ``None``.
        who: whose input ``x`` is.
    """
    where = "" if layer is None else f"layer {_checks.layer_name(layer)}; "
    return ValueError(
        "Expected more than 1 value per channel when training, got 1 value per channel "
        f"across the {size} {members} ({where}{who} input size {list(x.shape)})"
    )
