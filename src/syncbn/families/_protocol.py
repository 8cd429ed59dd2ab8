"""The family protocol: what the engine runs (:class:`Family`), what forward leaves for backward
(:class:`Record`), and where the statistics come from (:class:`Statistics`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch import Tensor


class Statistics(Protocol):
    """Where a training call's statistics come from (``Params.statistics``).

    Contract of :meth:`pool`:

    * Input: ``packed``, the group-summed float64 vector ``[N, S, Q]`` of this call, shape
      ``(2C + 1,)``: ``N`` the global count, ``S = sum x`` and ``Q = sum x^2`` per channel (the
      engine's packing, syncbn.engine._packing). On the host it may be a reused buffer.
    * Output: the ``[N', S', Q']`` to normalise with, same shape, dtype and device: ``packed``
      itself (it may be modified in place) or a new tensor. The engine unpacks it into the mean,
      the biased variance (what normalises), the unbiased one (the running update) and the count
      ``N'``, which the backward divides by: the backward is batch norm's with ``N'`` in place of
      this call's count, so sums added from elsewhere are constants of the step (CmBN: the earlier
      micro-batches' sums, ``N' = N_t``). The eager one-value check reads ``N'``.
    * Called exactly once per synchronised training forward, on every path (eager, ``torch.func``,
      traced, DataParallel replicas), after the collective and before the unpacking; it must not
      communicate. Under ``torch.compile`` it is traced: tensor operations
      only, no host reads, no recompilation per call (keep Python state out of guards).
    * Not called where no statistics are summed: eval, frozen layers, and the in-place family's
      one-process native kernel (taken only with the default :data:`THIS_CALL`).
    """

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
    """What a training forward leaves for its backward, every family and path (the one record).

    The statistics fields come first (the moments the engine computed are a record without an
    output); a family's forward fills in the rest.
    """

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
    """A layer family: the phases of its training call, in torch's phase names, that the engine runs.

    The engine (:mod:`syncbn.engine`) owns the moments, the collective, the statistics hook, the
    running update and autograd, and runs these phases over whatever family it holds, eager,
    ``torch.func``, double backward, traced and DataParallel alike. A family imports torch and
    :mod:`syncbn.families._arith` only. ``saved`` is the tensor it saves for backward: the input,
    or the output when :attr:`saves_output`; ``weight`` the weight its map used. Implementations:
    batch norm (:mod:`.batchnorm`), renorm (:mod:`.renorm`), in-place activated BN (:mod:`.inplace_abn`).
    """

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
