"""The protocol between the engine and what it normalises with: the statistics hook.

:class:`Statistics` is the seam through which the engine obtains the statistics a training call
normalises with. The engine sums the call's packed moments over the group (ONE collective), then
hands the summed vector to ``params.statistics.pool`` and normalises with what it returns, on
every path (eager, ``torch.func``, traced/compiled, DataParallel replicas).
"""

from __future__ import annotations

from typing import Protocol

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
    * Called exactly once per synchronised training forward, after the collective and before the
      unpacking; it must not communicate. Under ``torch.compile`` it is traced: tensor operations
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
