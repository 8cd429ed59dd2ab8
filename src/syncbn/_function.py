"""The autograd function that joins the math (:mod:`syncbn._math`) to a group.

One ``all_reduce`` in forward (packed moments, ``2C + 1`` float64 values) and
one in backward (``2C`` values in the statistics dtype, at least float32) per
call, whatever the world size.

Device-to-host synchronisation: none when this rank holds at least two values
per channel, because the global count is then known to be at least two without
looking. Only a rank holding zero or one value per channel reads the global
count back (``.item()``), to decide between an empty batch, the "more than one
value per channel" error and the normal path. Every rank whose global count is
below two is such a rank, so all of them take the same decision.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from . import _checks, _config, _math
from .groups import (
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OTHER,
    CollectiveError,
    ProcessGroupSum,
    SumGroup,
    Tag,
)

__all__ = [
    "ForwardResult",
    "SyncBatchNormFunction",
    "finish_input_grad",
    "local_grad_sums",
    "statistics_dtype",
    "synchronized_forward",
]


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


def _expected_more_than_one(x: Tensor, group: SumGroup, layer: Any) -> ValueError:
    return ValueError(
        "Expected more than 1 value per channel when training, got 1 value per channel "
        f"across the {group.size} ranks of the group ("
        + ("" if layer is None else f"layer {_checks.layer_name(layer)}; ")
        + f"this rank's input size {list(x.shape)})"
    )


_PHASE_CODES = {"forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}


def _all_reduce(group: SumGroup, tensor: Tensor, layer: Any, phase: str) -> Tensor:
    """Sum ``tensor`` over ``group``, framed with the call's identity (:mod:`syncbn.groups`).

    Every collective of a layer goes through here: over a process group the
    frame carries the layer's identity (:func:`syncbn._checks.layer_identity`),
    the phase, dtype and size, checked on every rank. On an accelerator
    (``_host_side`` false) the check is deferred to the group's next call, so
    that no device-to-host synchronisation is added; debug mode checks at once.
    """
    try:
        if type(group) is ProcessGroupSum:
            tag = Tag(_checks.layer_identity(layer, group), _PHASE_CODES.get(phase, PHASE_OTHER))
            deferred = not _host_side(tensor) and not _config.debug_enabled()
            return group.all_reduce_sum(tensor, tag, deferred=deferred)
        return group.all_reduce_sum(tensor)
    except CollectiveError as exc:
        raise exc.for_layer(_checks.layer_name(layer), phase) from exc.__cause__


def _host_side(x: Tensor) -> bool:
    """Whether ``x`` lives in host memory: reading a value back then costs no device synchronisation.

    The one switch between the CPU flow (output buffer as scratch, count read on
    the host) and the accelerator flow (no host reads); tests flip it to run the
    accelerator flow on CPU.
    """
    return x.device.type == "cpu"


class ForwardResult(NamedTuple):
    """What a synchronised training forward produced, and what its backward needs."""

    out: Tensor
    mean: Tensor  # global mean, statistics dtype
    var: Tensor  # global biased variance, statistics dtype
    total: float | Tensor  # global count: a float on CPU, a 0-dim float64 tensor on a device
    local_count: int  # this member's values per channel


def synchronized_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    momentum: float,
    reduce: Callable[[Tensor], Tensor],
    one_value_error: Callable[[], Exception],
) -> ForwardResult:
    """Training-mode batch norm of ``x`` with statistics summed by ``reduce``.

    The transport-independent forward shared by the process-group path
    (:class:`SyncBatchNormFunction`) and the ``nn.DataParallel`` replicas
    (:mod:`syncbn.parallel`): local moments, one ``reduce`` of the packed
    moments, normalisation into a freshly allocated output (which also served
    as the scratch buffer for the moments) and the running-statistics update.
    Every per-channel step is a single tensor operation on all channels at
    once: on small layers the number of operations, not the bytes, sets the
    time.

    Args:
        x: the local input ``(N, C, *)``.
        weight: affine scale or ``None``.
        bias: affine shift or ``None``.
        running_mean: updated in place unless ``None``.
        running_var: updated in place (unbiased variance) unless ``None``.
        eps: added to the variance.
        momentum: running-statistics update factor.
        reduce: sums a float64 vector over every member, returning the sum.
        one_value_error: builds the error raised when the global count is one.

    Returns:
        The output and the statistics backward needs.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    host = _host_side(x)
    # On CPU the output buffer doubles as the moments' scratch space of the two-pass
    # statistics (see local_moments); the native kernel (CUDA, small inputs) needs none,
    # and the normalisation then allocates its own output.
    out = torch.empty_like(x) if host and not _math.uses_native_statistics(x) else None
    if count > 0:
        mean_l, var_l = _math.local_moments(x, scratch=out)
        packed = _math.pack_moments(count, mean_l, var_l, channels=channels, device=x.device)
    else:
        packed = _math.pack_moments(0, None, None, channels=channels, device=x.device)
    total, stats64 = _math.unpack_moments(reduce(packed), channels, read_count=host)

    global_count = 2.0  # a lower bound is all that is needed when count >= 2
    if count < 2:
        global_count = total if isinstance(total, float) else float(total.item())
        if global_count == 1:
            raise one_value_error()

    stat_dtype = statistics_dtype(x, weight, running_mean)
    mean, var, unbiased = _math.cast(stats64, stat_dtype).unbind(0)
    if count > 0:
        out = _math.normalize(x, weight, bias, mean, var, eps, out=out)
    elif out is None:
        out = torch.empty_like(x)
    if global_count > 0:
        _math.update_running(running_mean, running_var, mean, unbiased, momentum)
    return ForwardResult(out, mean, var, total, local_count=count)


def local_grad_sums(
    grad_output: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, var: Tensor, eps: float, count: int
) -> tuple[Tensor, Tensor]:
    """This member's ``(sum(dy), sum(dy * xhat))``; zeros for an empty local batch (``count == 0``)."""
    if count > 0:
        return _math.backward_sums(grad_output, x, weight, mean, var, eps)
    zeros = torch.zeros(x.shape[1], dtype=mean.dtype, device=x.device)
    return zeros, zeros.clone()


def finish_input_grad(
    grad_output: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    var: Tensor,
    eps: float,
    total: float | Tensor,
    count: int,
    reduced: Tensor,
) -> Tensor:
    """Input gradient from the group-summed ``[[sum(dy)], [sum(dy * xhat)]]`` (``reduced``, ``(2, C)``).

    ``total`` is the global count, ``count`` this member's; an empty local batch
    gets an empty (all-zero) gradient.
    """
    if count == 0:
        return torch.zeros_like(x)
    if reduced.device != x.device:  # nn.DataParallel: summed on the first replica's device
        reduced = reduced.to(x.device)
    return _math.input_grad(grad_output, x, weight, mean, var, eps, total, reduced)


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm whose statistics span every member of ``group``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: SumGroup,
        layer: Any = None,
    ) -> Tensor:
        call = _checks.before_forward(group, layer, x)
        result = synchronized_forward(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            eps,
            momentum,
            lambda packed: _all_reduce(group, packed, layer, "forward"),
            lambda: _expected_more_than_one(x, group, layer),
        )
        ctx.save_for_backward(x, weight, result.mean, result.var)
        ctx.total = result.total
        ctx.count = result.local_count
        ctx.param_dtype = (
            weight.dtype if weight is not None else (bias.dtype if bias is not None else result.mean.dtype)
        )
        ctx.eps = eps
        ctx.group = group
        ctx.layer = layer
        ctx.call = call
        return result.out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xhat = local_grad_sums(grad_output, x, weight, mean, var, ctx.eps, ctx.count)

        grad_input = None
        if need_input:
            _checks.before_backward(ctx.group, ctx.layer, grad_output, ctx.call)
            reduced = _all_reduce(ctx.group, _math.pack_grad_sums(sum_dy, sum_dy_xhat), ctx.layer, "backward")
            grad_input = finish_input_grad(
                grad_output, x, weight, mean, var, ctx.eps, ctx.total, ctx.count, reduced
            )

        grad_weight = _math.cast(sum_dy_xhat, ctx.param_dtype) if need_weight else None
        grad_bias = _math.cast(sum_dy, ctx.param_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
