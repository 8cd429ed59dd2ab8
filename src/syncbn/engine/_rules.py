"""The engine's rules shared by every family and path: dtypes, the "one value per channel" error, tracing.

The tracing helpers tell the layers whether dynamo is tracing (:data:`is_compiling`),
whether a forward is a recomputation inside a backward (:func:`in_backward`:
``torch.utils.checkpoint``), and warn once per traced graph (:func:`warn_while_tracing`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _checks
from . import _math

__all__ = [
    "gradient_dtype",
    "in_backward",
    "is_compiling",
    "one_value_error",
    "statistics_dtype",
    "warn_while_tracing",
]

# torch.compiler.is_compiling exists from torch 2.3 on; torch 2.2 has the dynamo spelling.
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id  # torch 2.2 has it (checked)


@torch._dynamo.assume_constant_result
def warn_while_tracing(message: str) -> bool:
    """Warn once per traced graph (dynamo runs this while tracing, never in the compiled code)."""
    warnings.warn(message, stacklevel=2)
    return True


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread right now.

    A training forward inside a backward is a recomputation: ``torch.utils.checkpoint``
    (reentrant and non-reentrant) re-runs the checkpointed forward there.
    """
    return bool(_current_graph_task_id() != -1)


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
