""":class:`CollectiveError`, and :class:`Reporting`: a group's words, its wait bound and its errors."""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from .. import _config, _shm
from ._frame import describe_fields, differing
from ._own import timeout_s
from ._refs import group_ranks

_LIKELY_CAUSES = (
    "Likely causes: a rank skipped this layer or called the SyncBatchNorm layers in a different "
    "order (a data-dependent branch, an early `continue`); a rank is in eval mode or has "
    "freeze=True while the others train; a rank is still busy elsewhere (data loading, "
    "checkpointing, rank-0-only evaluation): raise the bound with SYNCBN_TIMEOUT=<seconds> or "
    "syncbn.set_timeout(); a rank died."
)
_AFTER_FAILURE = (
    " The process group is unusable after this error: end the job, or call "
    "torch.distributed.destroy_process_group(), init_process_group() again and "
    "syncbn.sync_buffers(model) (see the Robustness page of the syncbn documentation, section 'Recovery')."
)


class CollectiveError(RuntimeError):
    """A SyncBatchNorm collective timed out, failed, or the ranks made different calls.

    Every argument but ``message`` is kept as the attribute of the same name; pickling and ``copy`` keep the
    message and every attribute (an error raised in a worker process reaches its parent whole).

    Args:
        message: the full explanation (layer, group, time waited, likely causes).
        timed_out: whether the bound on the wait was reached.
        waited: seconds this rank waited.
        group_size: number of ranks in the group.
        detail: the transport's own error text, if any.
        layer: the layer's name, or ``None`` before the layer is known.
        mismatch: the ranks made different collectives at the same point (the frame headers
            disagree): every rank raises it at once, no state changed, and the group stays
            usable. Else (a timeout, a dead peer) the group is unusable.

    Example::

        >>> try:
        ...     loss = criterion(model(x), y)      # a peer skipped a SyncBatchNorm layer
        ... except syncbn.CollectiveError as exc:
        ...     print(exc.layer, exc.timed_out, exc.mismatch, f"{exc.waited:.0f} s")
        ...     raise
    """

    def __init__(
        self,
        message: str,
        *,
        timed_out: bool,
        waited: float,
        group_size: int,
        detail: str = "",
        layer: str | None = None,
        mismatch: bool = False,
    ) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.waited = waited
        self.group_size = group_size
        self.detail = detail
        self.layer = layer
        self.mismatch = mismatch

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied with its message and fields (the keyword-only ``__init__`` is not re-run)."""
        return (_restore, (type(self), self.args), self.__dict__)

    def _rephrased(self, message: str, **changes: Any) -> CollectiveError:
        """The same error with another message (and ``changes`` to its fields), caused by this one."""
        kept = {k: getattr(self, k) for k in ("timed_out", "waited", "group_size", "detail", "mismatch")}
        new = CollectiveError(message, **{**kept, **changes})
        new.__cause__ = self
        return new

    def for_layer(self, layer: str, phase: str) -> CollectiveError:
        """The same error, its message starting with the layer and the phase."""
        new = self._rephrased(f"syncbn: layer {layer} ({phase}): {self.args[0]}", layer=layer)
        new.__cause__ = self.__cause__
        return new


def _restore(cls: type[CollectiveError], args: tuple[Any, ...]) -> CollectiveError:
    new = cls.__new__(cls)
    new.args = args
    return new


def bound_source() -> str:
    """Where the wait bound comes from, in words."""
    if _config.get_timeout() is None:
        return "the process group's timeout, SYNCBN_TIMEOUT being none"
    return "SYNCBN_TIMEOUT/syncbn.set_timeout"


class Reporting:
    """The group in words and the errors that name it (a base of ``ProcessGroupSum``)."""

    def __init__(self, process_group: Any) -> None:
        # Held weakly: a destroyed process group must not survive in syncbn.
        self._default = process_group is None
        self._live: weakref.ref[Any] = weakref.ref(
            dist.group.WORLD if process_group is None else process_group
        )
        if isinstance(process_group, dist.ProcessGroupGloo):  # a wire of syncbn's own (_hier)
            self._size, self._rank = process_group.size(), process_group.rank()
        else:
            self._size, self._rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self._shared: _shm.SharedMemorySum | None = None  # set at the first CPU collective
        self._pg_timeout_s: float | None = None  # read once: _bound_s is on the hot path
        self.names: dict[int, str] = {}  # layer identity -> name, for the errors

    @property
    def process_group(self) -> Any:
        """The wrapped process group (``None``: the default group)."""
        return None if self._default else self._live()

    def _bound_s(self) -> float:
        """The wait bound: syncbn's, else the process group's own timeout."""
        bound = _config.get_timeout()
        if bound is not None:
            return bound
        if self._pg_timeout_s is None:
            self._pg_timeout_s = timeout_s(self.process_group)
        return self._pg_timeout_s

    def describe(self) -> str:
        """The group in words: size, global ranks (when known) and this member's rank."""
        try:
            ranks: Any = group_ranks(self.process_group)
            if len(ranks) > 16:
                ranks = f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
        except Exception:  # noqa: BLE001 - best effort in an error path
            ranks = "unknown"
        which = "the default group" if self.process_group is None else "process group"
        via = ", through shared memory" if self._shared is not None else ""
        return f"{which} of {self._size} ranks (global ranks {ranks}; this is group rank {self._rank}{via})"

    def _refused(self, message: str) -> CollectiveError:
        """A call refused before anything was sent."""
        return CollectiveError(message, timed_out=False, waited=0.0, group_size=self._size)

    def _shm_error(self, exc: _shm.SharedMemoryError) -> CollectiveError:
        if exc.mismatch:
            sent = "; ".join(
                f"rank {r}: " + ("absent (shadowing)" if f is None else describe_fields(list(f), self.names))
                for r, f in enumerate(exc.ranks)
            )
            return self._mismatch(f"the ranks disagree on {', '.join(differing(exc.ranks))} ({sent})")
        if exc.timed_out:
            return self._error(None, exc.waited, self._bound_s())
        return self._error(exc, exc.waited, None, failed=str(exc))

    def _error(
        self, exc: BaseException | None, waited: float, timeout: float | None, failed: str = ""
    ) -> CollectiveError:
        text = "" if exc is None else f"{type(exc).__name__}: {exc}".strip()
        timed_out = not failed and (
            exc is None
            or any(word in text.lower() for word in ("timed out", "timeout"))
            or (timeout is not None and waited >= 0.95 * timeout)
        )
        if timed_out:
            bound = "" if timeout is None else f" (bound: {timeout:g} s: {bound_source()})"
            head = (
                f"waited {waited:.1f} s{bound} for the all_reduce over {self.describe()}, "
                f"and not every rank arrived. {_LIKELY_CAUSES}"
            )
        else:
            reason = failed or "a peer process most likely died or closed its connection"
            head = (
                f"the all_reduce over {self.describe()} failed after {waited:.1f} s: {reason}. "
                "Check the other ranks' logs for the first error."
            )
        message = head + _AFTER_FAILURE
        if text and not failed:
            message += f" [{text.splitlines()[0][:300]}]"
        return CollectiveError(
            message, timed_out=timed_out, waited=waited, group_size=self._size, detail=text
        )

    def _mismatch(self, text: str) -> CollectiveError:
        message = (
            f"the ranks of {self.describe()} did not make the same collective: {text}. No state was "
            "changed and the group is still usable. Every rank must call the SyncBatchNorm layers in "
            "training in the same order (the same layers, forward then backward); a rank that caught "
            "an exception between a forward and its backward is out of step. Run every rank with "
            "SYNCBN_DEBUG=1 to check every call against its layer's name."
        )
        return CollectiveError(
            message, timed_out=False, waited=0.0, group_size=self._size, detail=text, mismatch=True
        )
