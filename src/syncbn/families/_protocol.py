"""The family protocol: what the engine runs (:class:`Family`), what forward leaves for backward
(:class:`Record`), and where the statistics come from (:class:`Statistics`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch import Tensor


class Statistics(Protocol):
    """Where a training call's statistics come from (``Params.statistics``; docs/architecture.md).
    :meth:`pool` takes this call's group-summed float64 ``[N, S, Q]`` (``(2C + 1,)``, maybe a reused buffer)
    and returns the ``[N', S', Q']`` to normalise with (``packed`` itself or a new tensor); backward divides
    by ``N'``. Called once per synchronised training forward, after the collective, on every path: it must not
    communicate, nor read the host when traced. Not called in eval, when frozen, or by the in-place family's
    one-process native kernel (taken only with :data:`THIS_CALL`)."""

    def pool(self, packed: Tensor) -> Tensor: ...


class ThisCall:
    """The default :class:`Statistics`: the group's global moments of this call, unchanged."""

    __slots__ = ()

    def pool(self, packed: Tensor) -> Tensor:
        return packed

    def __repr__(self) -> str:
        return "THIS_CALL"


THIS_CALL = ThisCall()


class Record(NamedTuple):
    """What a training forward leaves for its backward, every family and path: the engine's
    statistics first (its moments are a record without an output), then the family's fields."""

    mean: Any  # what normalised (statistics dtype); eval: the running mean
    var: Any  # the biased variance; eval: the running one
    eps: float
    total: Any  # global count N (the pooled one): a float on the host, else a 0-dim tensor
    local_count: int  # this member's values per channel
    unbiased: Any = None  # the running update's variance
    global_count: float = 0.0  # eager: N, or the lower bound 2.0 where this member holds >= 2 values
    out: Any = None  # the output (a family that saves its output: the input, overwritten)
    weight: Any = None  # the weight the elementwise map used (a family's effective one)
    correction: Any = None  # the family's constants of the step (renorm's (r, d)), or None
    invstd: Any = None  # 1 / sqrt(var + eps), where the family keeps it (the in-place family)
    training: bool = True  # False: constant statistics (the in-place family in eval)
    bias: Any = None  # the bias the elementwise map used (traced path)
    native: bool = False  # made by the family's one-kernel forward (its backward is one kernel too)


class Family(Protocol):
    """A layer family: the phases the engine runs (docs/architecture.md); ``saved``: the input, or the
    output when :attr:`saves_output`; ``weight``: the weight its map used."""

    # Protocol questions: what differs between families, answered by each.
    training: bool  # False: normalise with the running statistics (constants: no collective, no update)
    saves_output: bool  # writes the output over the input and saves it (marked dirty); else saves x
    second_order: bool  # whether its backward is differentiable (else double backward raises)
    members: str  # the one-value error's words for the group's members
    double_backward_error: str  # the RuntimeError message where not :attr:`second_order`

    def snapshot(self, copy: Callable[[Tensor], Tensor]) -> Family:
        """This family with ``copy`` of the state it reads that a traced graph updates in place."""

    def check_input(self, x: Tensor) -> None:
        """Raise before anything changes where the family cannot run on ``x``."""

    def alone(self, x: Tensor, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float,
              eps: float, engine: Callable[[], Tensor]) -> Tensor | None:  # fmt: skip
        """One member with nothing listening: the family's one-process call (``engine()``: the
        engine without a collective), or ``None`` to synchronise over the one member."""

    # The eager kernel set (native kernels, reused buffers).
    def native_forward(
        self, x: Tensor, weight: Any, bias: Any, params: Any, stat: torch.dtype
    ) -> Record | None:
        """This member alone, count > 1: a one-kernel forward with the running update, or ``None``."""

    def forward(self, x: Tensor, weight: Any, bias: Any, moments: Record, out: Tensor | None) -> Record:
        """The elementwise map with ``moments`` (into ``out`` when given): the record for backward."""

    def grad_sums(self, saved: Tensor, grad: Tensor, weight: Any, bias: Any, record: Record,
                  need_input: bool) -> tuple[Any, Tensor, Tensor]:  # fmt: skip
        """The backward's local reduction ``(carry, sum(dy), sum(dy * xhat))``; ``carry`` feeds input_grad."""

    def input_grad(self, saved: Tensor, grad: Tensor, weight: Any, bias: Any, record: Record, carry: Any,
                   reduced: Any) -> Tensor:  # fmt: skip
        """The input gradient from the group-summed ``reduced`` ``(2, C)`` (``None``: constant statistics)."""

    def parameter_grads(
        self, sum_dy: Tensor, sum_dy_xhat: Tensor, weight: Any, correction: Any
    ) -> tuple[Any, Any]:
        """``(dweight, dbias)`` from the local sums (``correction``: the record's)."""

    def differentiable_weight(self, weight: Any, correction: Any) -> Any:
        """The weight the map used, differentiable in the layer's ``weight`` (double backward)."""

    # The traced kernel set (plain tensor operations, no host reads).
    def traced_forward(self, x: Tensor, weight: Any, bias: Any, mean: Tensor, var: Tensor, invstd: Tensor,
                       eps: float) -> tuple[Tensor, Any, Any, Any]:  # fmt: skip
        """``(out, weight, bias, correction)``: the elementwise map and what it used."""

    def traced_grad_terms(self, saved: Tensor, grad: Tensor, weight: Any, bias: Any, mean: Tensor,
                          invstd: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """``(dy, xhat, scale)``: the gradient at the normalisation, ``xhat``, and ``w * invstd`` (a view)."""

    def vmap_error(self, batched_input: bool, batched_parameters: bool) -> str:
        """The ``NotImplementedError`` message of a ``vmap`` the family refuses."""
