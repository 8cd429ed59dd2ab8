"""The engine's rules shared by every family and path: dtypes, the "one value per channel" error, tracing."""

from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from .. import _checks
from . import _math

# torch.compiler.is_compiling exists from torch 2.3 on; torch 2.2 has the dynamo spelling.
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id  # torch 2.2 has it (checked)
_F = TypeVar("_F", bound=Callable[..., Any])


def constant_while_tracing(fn: _F) -> _F:
    """``torch._dynamo.assume_constant_result`` without importing dynamo at ``import syncbn`` (about
    1.5 s of every process's start): the decorator only marks the function so, and dynamo reads the mark
    when it traces a call (tests/test_imports.py checks the mark is torch's)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_while_tracing
def warn_while_tracing(message: str) -> bool:
    """Warn once per traced graph (dynamo runs this while tracing, never in the compiled code)."""
    warnings.warn(message, stacklevel=2)
    return True


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread (a forward there is a checkpoint's recomputation)."""
    return bool(_current_graph_task_id() != -1)


def statistics_dtype(x: Tensor, weight: Tensor | None, running_mean: Tensor | None) -> torch.dtype:
    """The statistics dtype: the parameters' or buffers' when there are any, else after the input."""
    if weight is not None:
        return weight.dtype
    if running_mean is not None:
        return running_mean.dtype
    return _math.accumulation_dtype(x.dtype)


def affine_for_statistics(
    running_mean: Tensor | None, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """``weight`` and ``bias`` in the running statistics' dtype where it is the wider (FSDP2's bfloat16
    parameters beside float32 buffers: torch's kernels take the reverse), differentiably."""
    if running_mean is None or weight is None or weight.dtype == running_mean.dtype:
        return weight, bias
    if torch.promote_types(weight.dtype, running_mean.dtype) != running_mean.dtype:
        return weight, bias
    return weight.to(running_mean.dtype), None if bias is None else bias.to(running_mean.dtype)


def gradient_dtype(weight: Tensor | None, bias: Tensor | None, mean: Tensor) -> torch.dtype:
    """The dtype of the weight and bias gradients: the parameters', else the statistics' (``mean``)."""
    if weight is not None:
        return weight.dtype
    return bias.dtype if bias is not None else mean.dtype


def one_value_error(
    x: Tensor, size: int, members: str, layer: Any = None, who: str = "this rank's"
) -> ValueError:
    """The error of a training call whose global count is one over ``size`` ``members``, in every path."""
    where = "" if layer is None else f"layer {_checks.layer_name(layer)}; "
    return ValueError(
        "Expected more than 1 value per channel when training, got 1 value per channel "
        f"across the {size} {members} ({where}{who} input size {list(x.shape)})"
    )
