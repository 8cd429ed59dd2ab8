"""``ProcessGroupSum``: the transport per call, the call count and the lifecycle (forks, destroyed groups)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _config, _shm
from . import _ddp, _hier, _own
from ._frame import ANONYMOUS, FAST_DTYPES, PAYLOAD, PHASE_CHECK, PHASE_SETUP, SEQUENCE, ShadowResult, Tag
from ._transport import FramedTransport

# While a syncbn.join.JoinableSyncBatchNorm is active: its wrapper of the default group (set_join).
_join: Callable[[ProcessGroupSum], Any] | None = None


def set_join(wrap: Callable[[ProcessGroupSum], Any] | None) -> None:
    """Install (``None``: remove) the active Join's ``wrap(group)``."""
    global _join
    _join = wrap


def joined(group: Any) -> Any:
    """``group`` as a training call uses it now: under an active Join, the Join's wrapper of it."""
    if _join is None or type(group) is not ProcessGroupSum or group.process_group is not None:
        return group
    return _join(group)


class ProcessGroupSum(FramedTransport):
    """:class:`SumGroup` over a ``torch.distributed`` process group, every call framed.

    Args:
        process_group: the group, or ``None`` for the default (world) group.
        shared_memory: ``False`` keeps CPU collectives on the process group's transport even
            where every rank is on one machine; ``None`` follows :func:`syncbn.set_shared_memory`
            / ``SYNCBN_SHM`` (on by default). The ranks agree at the first CPU collective.
        hierarchical: for a group spanning several machines, sum within each machine through shared memory and
            across machines over a leaders' subgroup; ``None`` follows ``SYNCBN_HIERARCHICAL`` (on by
            default). Every rank must choose alike (else every rank raises).
        own_group: ``process_group`` is one syncbn made for this group alone (the ``Join`` group,
            the hierarchy's subgroups): its frames go over it directly.

    CPU frames travel over a gloo group of this group's own whose timeout is the wait bound, so
    a process can recover or exit within seconds of a :class:`CollectiveError`.

    Example::

        >>> group = ProcessGroupSum()                       # inside an initialised job
        >>> t = torch.ones(3, dtype=torch.float64)
        >>> group.all_reduce_sum(t, Tag(layer=7, phase=PHASE_OTHER))  # doctest: +SKIP
        tensor([2., 2., 2.], dtype=torch.float64)           # on 2 ranks
    """

    framed = True  # the SumGroup protocol's capability: all_reduce_sum takes the call's Tag

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "all_reduce_sum" in cls.__dict__ and "framed" not in cls.__dict__:
            cls.framed = False  # an override of all_reduce_sum(tensor) is not told the tag

    def __init__(
        self,
        process_group: Any = None,
        *,
        shared_memory: bool | None = None,
        hierarchical: bool | None = None,
        own_group: bool = False,
    ) -> None:
        super().__init__(process_group, own_group)
        self._owner = _own.process_id
        # The CPU transports (shared memory, the hierarchy), chosen collectively at the first CPU collective.
        self._shared_memory_choice = shared_memory
        self._shared_ready = False
        self._hierarchical_choice = hierarchical
        self._hier: _hier.Hierarchy | None = None
        # Layer state -> its first-use ordinal identity, and the ordinals handed out (syncbn._checks).
        self.layer_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.layer_ordinals = 0
        self.closed = False

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def key(self) -> Any:
        """The live process group object (``None`` once destroyed), for "already verified" bookkeeping."""
        return self._live()

    def all_reduce_sum(
        self, tensor: Tensor, tag: Tag | None = None, *, deferred: bool | None = None
    ) -> Tensor:
        """Sum ``tensor`` in place over the group, framed and checked, waiting at most the bound.

        Args:
            tensor: the values to sum (any shape; float64, float32, float16 or bfloat16);
                overwritten with the sum.
            tag: the call's identity (:class:`Tag`); ``None``: anonymous.
            deferred: check the summed header at the next call instead of now (no device-to-host
                synchronisation); ``None``: deferred for accelerator tensors outside debug mode.

        Returns:
            ``tensor``, now holding the sum.

        Raises:
            CollectiveError: the ranks made different calls (``mismatch``; every rank, the group
                stays usable), the wait exceeded the bound, or the transport failed (a peer
                died); the group is unusable after the latter two.

        Shape:
            any; the result has the shape of ``tensor``.
        """
        return self._framed(tensor, tag or ANONYMOUS, host_wait=False, deferred=deferred)

    def all_reduce_sum_bounded(self, tensor: Tensor, *, host_wait: bool, tag: Tag | None = None) -> Tensor:
        """:meth:`all_reduce_sum`, optionally bounding the wait (and checking the header) on the host.

        Args:
            tensor: the values to sum; overwritten with the sum.
            host_wait: bound the wait on the host even for an accelerator tensor.
            tag: the call's identity; ``None``: ``Tag(0, PHASE_CHECK)``.

        Returns:
            ``tensor``, now holding the sum.
        """
        deferred = False if host_wait else None
        return self._framed(tensor, tag or Tag(0, PHASE_CHECK), host_wait=host_wait, deferred=deferred)

    def shadow_sum(self, device: torch.device | str = "cpu") -> ShadowResult | None:
        """Take part in the other ranks' next framed call without contributing (DDP ``Join``).

        Sends absent frames (flag 0, zero payload): the participants' check and sum are unchanged
        (docs/internals/groups.md, "Join shadowing"). Always read on the host.

        Args:
            device: the device the participants use (``cpu`` for gloo, the rank's GPU for NCCL).

        Returns:
            What was shadowed, or ``None`` when no rank participated (the joined ranks are done).

        Raises:
            CollectiveError: as :meth:`all_reduce_sum`, and when the participants disagree.
        """
        dev = torch.device(device)
        self._enter()
        if self._hier is not None:
            raise self._refused(
                f"shadow_sum (DDP Join) is not available on a hierarchical group ({self.describe()})"
            )
        self._calls += 1
        shared = None
        if dev.type == "cpu":
            shared = self._shared if self._shared_ready else self._connect_shared()
        try:
            got = self._shadow_process_group(dev) if shared is None else shared.shadow(self._bound_s())
        except _shm.SharedMemoryError as exc:
            raise self._shm_error(exc) from exc
        self.last_participants = 0 if got is None else got[1]
        if got is None:
            return None
        (hi, lo, kind, _, n_hi, n_lo, _), k, total = got
        return ShadowResult(Tag((hi << 16) | lo, kind // 16), kind % 16, (n_hi << 16) | n_lo, k, total)

    @property
    def hierarchical(self) -> bool:
        """Whether this group's CPU collectives take the hierarchical path (known after its first one)."""
        return self._hier is not None

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this group's CPU collectives go through shared memory (known after its first one)."""
        return self._shared is not None

    def close(self) -> None:
        """Release the shared-memory mapping and the cached buffers (the group is not usable afterwards)."""
        self.closed = True
        for part in (self._shared, self._hier):
            if part is not None:
                part.close()
        self._shared, self._hier = None, None
        self._frame_cpu = None
        self._payload_views = {}
        if self._frame_words is not None:
            self._frame_words.release()
            self._frame_words = None
        self._pending.clear()
        self._wire_ref = None
        if self._release is not None:
            self._release()  # destroys the group carrying the frames, in order (see _own)

    def _enter(self) -> None:
        if self._owner != _own.process_id:
            raise self._refused(
                f"this process (pid {_own.process_id}) was forked from pid {self._owner} after the "
                f"SyncBatchNorm group over {self.describe()} was set up; a forked child cannot take part "
                "in its parent's collectives (it would silently join them). Initialise a process group "
                "of the child's own (or use the 'spawn' start method)."
            )
        if self.closed or self._live() is None:
            raise self._refused(
                f"the SyncBatchNorm group over {self.describe()} was closed (its process group was destroyed)"
            )
        if self._pending:
            self.check_pending(wait=False)
        if _ddp._wrappers and not self._own_group:
            _ddp.check()  # Join([ddp]) without JoinableSyncBatchNorm: every rank, nothing sent

    def _connect_shared(self) -> _shm.SharedMemorySum | None:
        """Choose the CPU transport (collective: every rank's first CPU collective on this group)."""
        calls = self._calls

        def exchange(t: Tensor) -> Tensor:
            self._calls += 1
            return self._frames(t, Tag(0, PHASE_SETUP), host_wait=True, deferred=False)

        choice = self._shared_memory_choice
        allowed = _config.shared_memory_enabled() if choice is None else choice
        hierarchical = _hier.choice(self._hierarchical_choice)  # read (a bad value raises) before sending
        self._shared = _shm.connect(self._rank, self._size, allowed, exchange)
        if self._shared is None and self._size > 2:  # every rank: they agree on the choice too
            self._hier = _hier.connect(self, hierarchical, allowed and _shm.supported(), exchange)
        if self._shared is None and self._hier is None:
            self._make_wire()  # collective: every member is here, just shown alive
        self._calls = calls
        self._shared_ready = True
        return self._shared

    def _framed(self, tensor: Tensor, tag: Tag, *, host_wait: bool, deferred: bool | None) -> Tensor:
        self._enter()
        self._calls += 1
        n = tensor.numel()
        if tensor.is_cpu:  # (``device.type`` makes a device object: ~0.2 us a call)
            shared = self._shared if self._shared_ready else self._connect_shared()
            if shared is not None:
                fields = self._prepared(tag, tensor.dtype, n)[0]
                fields[SEQUENCE] = self._calls & 0xFFFF
                # A contiguous tensor goes flat: the exchange's one-round path (~2 us cheaper).
                flat = tensor if tensor.dim() == 1 or not tensor.is_contiguous() else tensor.view(-1)
                try:
                    shared.all_reduce_sum(flat, self._bound_s(), fields)
                except _shm.SharedMemoryError as exc:
                    raise self._shm_error(exc) from exc
                self.last_participants = shared.last_participants
                return tensor
            if self._hier is not None:
                return self._hier.all_reduce_sum(tensor, tag, host_wait)
        if deferred is None:
            deferred = tensor.device.type != "cpu" and not host_wait and not _config.debug_enabled()
        if (
            not deferred
            and n <= PAYLOAD
            and tensor.device.type == "cpu"
            and tensor.dtype in FAST_DTYPES
            and not tensor.requires_grad
            and tensor.is_contiguous()
        ):
            return self._one_cpu_frame(tensor, tag, host_wait)
        return self._frames(tensor, tag, host_wait=host_wait, deferred=deferred)

    def __repr__(self) -> str:
        return f"ProcessGroupSum(rank={self._rank}, size={self._size})"
