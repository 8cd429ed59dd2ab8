"""The communication seam: "sum these tensors across my group", framed.

Synchronized batch norm needs exactly one operation from its transport: an
elementwise SUM of a small vector over every member of a group, the result
landing on every member. Per layer and training step that happens twice:

1. forward: the packed moments ``[n, n*mean, m2 + n*mean^2]`` (``2C + 1`` values);
2. backward: ``[sum(dy), sum(dy * xhat)]`` (``2C`` values).

A :class:`SumGroup` hides where the other members are:

* :class:`ProcessGroupSum` wraps a ``torch.distributed`` process group (any
  backend: gloo, NCCL, MPI) and runs ``all_reduce``, or, for CPU tensors of
  ranks on one machine, the shared-memory sum of :mod:`syncbn._shm`;
* no group at all (single process, or a group of one) is represented by
  ``None`` from :func:`resolve`: callers then run plain batch norm.

Framing: the protocol
---------------------
Every collective this module sends, on every transport, is *framed*: it
carries a header that says which call it belongs to, and every rank checks the
headers of all ranks on every call, inside the same collective (no extra one).
A call is described by seven small integers (each ``< 2**16``), the
:data:`FIELDS`:

==========  ==============================================================
layer_hi,   the caller's :class:`Tag` ``layer`` (a 32-bit identity: a hash of
layer_lo    the layer's name, its first-use ordinal, ``0`` for anonymous calls)
kind        ``16 * phase + dtype code`` (phase: :data:`PHASE_FORWARD`,
            :data:`PHASE_BACKWARD`, :data:`PHASE_CHECK`, :data:`PHASE_SETUP`,
            :data:`PHASE_OTHER`; dtype of the caller's tensor, see
            :data:`DTYPE_CODES`)
sequence    this process's count of framed calls on this group, mod ``2**16``
count_hi,   the number of elements of the caller's tensor (up to ``2**32``)
count_lo
frame       the index of this frame within the call
==========  ==============================================================

*Process-group transport* (gloo, NCCL, MPI, and every vector of a group that
does not use shared memory): the wire unit is a **frame** of exactly
:data:`FRAME` float64 values, whatever the call::

    [ p, p*f0, p*f0^2, p*f1, p*f1^2, ..., p*f6, p*f6^2 | payload (FRAME - HEADER values) ]

``p`` is the participation flag: 1 for a rank that contributes, 0 for a rank
that only *shadows* the collective (a rank that has joined under DDP ``Join``,
see :meth:`ProcessGroupSum.shadow_sum`), which sends a zero frame. A vector of
``n`` values travels in ``max(1, ceil(n / PAYLOAD))`` frames (one
``all_reduce`` each), zero-padded; every frame carries the header (with its
own ``frame`` index). Because every ``all_reduce`` has the same size and
dtype, **no sequence of calls on any rank can hand the transport differently
sized tensors** (the cause of gloo's ``Received data size doesn't match
expected size`` process abort). Payloads of other dtypes (float32 backward
sums) are summed in float64 and cast back.

After the sum, with ``k = sum(p)`` participating ranks and, per field,
``S1 = sum(p*f)`` and ``S2 = sum(p*f^2)``: all participating ranks sent the
same ``f`` exactly when ``k * S2 == S1 ** 2`` (Cauchy-Schwarz, with equality
only for equal values; every sum is an integer below ``2**53`` for groups of
up to ``2**20`` ranks, so the float64 sums are exact, and the test is made on
Python integers). The agreed value is ``S1 / k``. In a group of two, a
disagreement can even be solved for both ranks' values (``f = (S1 +- sqrt(2*S2 - S1^2)) / 2``),
which the error message then names. Every rank receives the same sums, so
every rank reaches the same verdict at the same frame: a disagreement is a
:class:`CollectiveError` (``mismatch=True``) on every rank at once, raised
before the caller uses the payload, and the group stays usable (every rank
took part in the same collective). A shadowing rank learns from the first
summed frame how many values the participants sent and so how many frames
follow (:meth:`ProcessGroupSum.shadow_sum`).

*Shared-memory transport* (:mod:`syncbn._shm`): the header's fields and the
flag are written, as plain integers, into the 64-byte metadata line in front
of each rank's slot, together with a CRC-32 of the slot's data; a vector
longer than a slot (8,192 float64 values) takes several rounds, each with its
own ``frame`` index. Every rank reads every rank's line, so the comparison is
direct; every reader verifies every slot's checksum on a private copy before
summing it.

On an accelerator, reading the summed header on the host at once would add a
device-to-host synchronisation to every call. There the check is *deferred*:
the summed header is copied to pinned host memory without blocking, and the
verdict is read at the group's next framed call (or at :meth:`ProcessGroupSum.check_pending`),
when the copy has long landed. Sizes stay equal on the wire either way, so the
transport never aborts; what is lost is only "state unchanged": a call found
bad after the fact has already been used. Debug mode (``SYNCBN_DEBUG=1``)
checks on the host at once on every device.

Bounded waits
-------------
Every wait is bounded (:mod:`syncbn._config`: ``SYNCBN_TIMEOUT``,
:func:`syncbn.set_timeout`; with ``SYNCBN_TIMEOUT=none`` the process group's
own timeout, ``init_process_group(timeout=...)``, on every transport).
:class:`ProcessGroupSum` starts the ``all_reduce`` asynchronously and waits on
its work handle with that bound (gloo honours it). On an accelerator a bounded
host wait would add a device-to-host synchronisation, so there the wait is
left to the device stream and the bound is the process group's own timeout,
except in debug mode and for the consistency checks. Any failure of the
collective (timeout, a peer that closed its connection) becomes a
:class:`CollectiveError` that names the group; the autograd function adds the
layer's name. After a timeout or a failure the process group is unusable; a
rank that gave up on a shared-memory collective withdraws its slot, so a late
peer fails too instead of completing the call with the data left behind.

Lifecycle
---------
A :class:`ProcessGroupSum` belongs to the process that made it: a child forked
afterwards gets a :class:`CollectiveError` when it tries to use it (it would
otherwise join its parent's collectives). It holds its process group weakly,
and refuses use once that group is gone. :func:`resolve` caches one per live
process group and drops (and closes) those of destroyed groups, so
``destroy_process_group()`` + ``init_process_group()`` cycles keep file
descriptors and mappings flat.

An explicit process group cannot be pickled; :class:`ProcessGroupRef` stands in
for it inside a saved module and is looked up again, by its global ranks, on
first use after loading.
"""

from __future__ import annotations

import array
import math
import os
import time
import weakref
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from . import _config, _shm

__all__ = [
    "SumGroup",
    "ProcessGroupSum",
    "ProcessGroupRef",
    "CollectiveError",
    "Tag",
    "ShadowResult",
    "FIELDS",
    "FRAME",
    "HEADER",
    "PAYLOAD",
    "PHASE_FORWARD",
    "PHASE_BACKWARD",
    "PHASE_CHECK",
    "PHASE_SETUP",
    "PHASE_OTHER",
    "DTYPE_CODES",
    "resolve",
    "group_ranks",
]

PHASE_FORWARD = 1
PHASE_BACKWARD = 2
PHASE_CHECK = 3  # the first-use handshake and the debug checks (syncbn._checks)
PHASE_SETUP = 4  # the shared-memory set-up exchanges
PHASE_OTHER = 5  # anything else (syncbn.sync_buffers, tools)
PHASE_NAMES = {
    PHASE_FORWARD: "forward",
    PHASE_BACKWARD: "backward",
    PHASE_CHECK: "consistency check",
    PHASE_SETUP: "shared-memory set-up",
    PHASE_OTHER: "other",
}

#: Codes of the payload dtypes in the header's ``kind`` field (others: 15).
DTYPE_CODES = _shm.DTYPE_CODES
FIELDS = ("layer_hi", "layer_lo", "kind", "sequence", "count_hi", "count_lo", "frame")
#: float64 values of the header: the flag and (p*f, p*f^2) for each field.
HEADER = 1 + 2 * len(FIELDS)
#: float64 values of one frame on the process-group transport.
FRAME = 4112
#: payload values per frame.
PAYLOAD = FRAME - HEADER

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
    "syncbn.sync_buffers(model) (see docs/robustness.md, 'Recovery')."
)

# Set in a child process by os.register_at_fork: groups made before the fork are the parent's.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class CollectiveError(RuntimeError):
    """A SyncBatchNorm collective timed out, failed, or the ranks made different calls.

    Args:
        message: the full explanation (layer, group, time waited, likely causes).
        timed_out: see below.
        waited: see below.
        group_size: see below.
        detail: the transport's own error text, if any.
        layer: see below.
        mismatch: see below.

    Attributes:
        timed_out: whether the bound on the wait was reached.
        waited: seconds this rank waited.
        group_size: number of ranks in the group.
        layer: the layer's name, or ``None`` before the layer is known.
        mismatch: the ranks made different collectives at the same point (the
            frame headers disagree); every rank raises it at once, no state
            changed, and the group stays usable. Else (a timeout, a dead peer)
            the group is unusable.

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

    def for_layer(self, layer: str, phase: str) -> CollectiveError:
        """The same error, its message starting with the layer and the phase."""
        new = CollectiveError(
            f"syncbn: layer {layer} ({phase}): {self.args[0]}",
            timed_out=self.timed_out,
            waited=self.waited,
            group_size=self.group_size,
            detail=self.detail,
            layer=layer,
            mismatch=self.mismatch,
        )
        new.__cause__ = self.__cause__
        return new


class Tag(NamedTuple):
    """The caller's part of a framed call's identity.

    Args:
        layer: a 32-bit identity, equal on every rank for the same layer
            (``0``: an anonymous call site; then phase, dtype and size identify it).
        phase: one of the ``PHASE_*`` constants.
    """

    layer: int = 0
    phase: int = PHASE_OTHER


_ANONYMOUS = Tag()
_FAST_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class ShadowResult(NamedTuple):
    """What :meth:`ProcessGroupSum.shadow_sum` learnt about the call it shadowed.

    Attributes:
        tag: the participants' :class:`Tag`.
        dtype_code: the participants' payload dtype (:data:`DTYPE_CODES`).
        numel: number of values the participants summed.
        participants: how many ranks contributed (``p = 1``).
        total: the participants' sum, float64, ``count`` values.
    """

    tag: Tag
    dtype_code: int
    numel: int
    participants: int
    total: Tensor


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code for ``dtype`` (:data:`DTYPE_CODES`; 15 for any other)."""
    return DTYPE_CODES.get(dtype, 15)


def _dtype_name(code: int) -> str:
    for dtype, c in DTYPE_CODES.items():
        if c == code:
            return str(dtype).replace("torch.", "")
    return "another dtype"


def header_fields(tag: Tag, code: int, sequence: int, count: int, frame: int) -> list[int]:
    """The seven :data:`FIELDS` of a frame, each in ``[0, 2**16)``."""
    layer = tag.layer & 0xFFFFFFFF
    return [
        layer >> 16,
        layer & 0xFFFF,
        (tag.phase & 0xFFF) * 16 + (code & 15),
        sequence & 0xFFFF,
        (count >> 16) & 0xFFFF,
        count & 0xFFFF,
        frame & 0xFFFF,
    ]


def encode_header(fields: list[int], present: bool) -> list[float]:
    """``[p, p*f0, p*f0^2, ...]`` for one frame (zeros for a shadowing rank)."""
    if not present:
        return [0.0] * HEADER
    out = [1.0]
    for f in fields:
        out.append(float(f))
        out.append(float(f * f))
    return out


class Agreement(NamedTuple):
    """The verdict on a summed header."""

    participants: int
    values: list[int | None]  # the agreed value of each field, None where ranks differ
    pairs: list[tuple[int, int] | None]  # in a group of two, both values where they differ


def decode_header(summed: list[float], group_size: int) -> Agreement:
    """Check a summed header: which fields all participating ranks sent alike."""
    k = int(round(summed[0]))
    values: list[int | None] = []
    pairs: list[tuple[int, int] | None] = []
    for i in range(len(FIELDS)):
        s1 = int(round(summed[1 + 2 * i]))
        s2 = int(round(summed[2 + 2 * i]))
        if k > 0 and k * s2 == s1 * s1 and s1 % k == 0:
            values.append(s1 // k)
            pairs.append(None)
            continue
        values.append(None)
        pair = None
        if k == 2:
            disc = 2 * s2 - s1 * s1
            root = math.isqrt(disc) if disc >= 0 else -1
            if root >= 0 and root * root == disc and (s1 + root) % 2 == 0:
                pair = ((s1 - root) // 2, (s1 + root) // 2)
        pairs.append(pair)
    return Agreement(k, values, pairs)


def describe_fields(fields: list[int | None], names: dict[int, str] | None = None) -> str:
    """A call's fields in words: ``layer 'x' forward, call 7, 9 float64 values``."""
    out = []
    hi, lo = fields[0], fields[1]
    if hi is not None and lo is not None:
        layer = (hi << 16) | lo
        if layer:
            name = (names or {}).get(layer)
            out.append(f"layer {name}" if name else f"layer id {layer:#010x}")
        else:
            out.append("an anonymous call")
    kind = fields[2]
    if kind is not None:
        out.append(f"{PHASE_NAMES.get(kind // 16, 'phase ' + str(kind // 16))} of {_dtype_name(kind % 16)}")
    if fields[3] is not None:
        out.append(f"call {fields[3]}")
    if fields[4] is not None and fields[5] is not None:
        out.append(f"{(fields[4] << 16) | fields[5]} values")
    if fields[6] is not None:
        out.append(f"frame {fields[6]}")
    return ", ".join(out)


_FIELD_GROUPS = {
    "the layer": (0, 1),
    "the phase or the dtype": (2,),
    "the call count": (3,),
    "the number of values": (4, 5),
    "the frame": (6,),
}


def differing(per_rank: list[list[int] | None]) -> list[str]:
    """Which parts of the header differ among the participating ranks' fields."""
    taking = [f for f in per_rank if f is not None]
    return [
        what
        for what, idx in _FIELD_GROUPS.items()
        if any(any(f[i] != taking[0][i] for i in idx) for f in taking[1:])
    ]


def mismatch_message(mine: list[int], agreement: Agreement, names: dict[int, str] | None) -> str:
    """What differed, in words, from this rank's fields and the summed verdict."""
    differ = [what for what, idx in _FIELD_GROUPS.items() if any(agreement.values[i] is None for i in idx)]
    text = f"this rank sent {describe_fields(list(mine), names)}; the ranks disagree on {', '.join(differ)}"
    if all(p is None or mine[i] in p for i, p in enumerate(agreement.pairs)) and any(agreement.pairs):
        other: list[int | None] = []
        for i, pair in enumerate(agreement.pairs):
            if pair is None:
                other.append(mine[i] if agreement.values[i] is not None else None)
            else:
                other.append(pair[1] if pair[0] == mine[i] else pair[0])
        text += f" (the other rank sent {describe_fields(other, names)})"
    return text


@runtime_checkable
class SumGroup(Protocol):
    """A set of peers that can sum a tensor elementwise among themselves."""

    @property
    def size(self) -> int:
        """Number of members."""
        ...

    @property
    def rank(self) -> int:
        """This member's index in ``[0, size)``."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over all members; every member receives the result."""
        ...


class _Pending(NamedTuple):
    """A deferred header check: the summed header on its way to (or in) host memory."""

    summed: Tensor
    event: Any
    mine: list[int]
    tag: Tag


def _pg_timeout(process_group: Any) -> float:
    """The process group's own timeout in seconds (its backend's options; 1800 if unknown)."""
    try:
        group = dist.group.WORLD if process_group is None else process_group
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - any backend without readable options
        return 1800.0


class ProcessGroupSum:
    """:class:`SumGroup` over a ``torch.distributed`` process group, every call framed.

    Args:
        process_group: the group, or ``None`` for the default (world) group.
        shared_memory: ``False`` keeps CPU collectives on the process group's
            transport even where every rank is on one machine; ``None`` follows
            :func:`syncbn.set_shared_memory` / ``SYNCBN_SHM`` (on by default).
            Either way the ranks agree collectively at the first CPU collective.

    Example::

        >>> group = ProcessGroupSum()                       # inside an initialised job
        >>> t = torch.ones(3, dtype=torch.float64)
        >>> group.all_reduce_sum(t, Tag(layer=7, phase=PHASE_OTHER))  # doctest: +SKIP
        tensor([2., 2., 2.], dtype=torch.float64)           # on 2 ranks
    """

    def __init__(self, process_group: Any = None, *, shared_memory: bool | None = None) -> None:
        # Held weakly: a destroyed process group must not survive in syncbn (its sockets, its fds).
        self._default = process_group is None
        self._live: weakref.ref[Any] = weakref.ref(
            dist.group.WORLD if process_group is None else process_group
        )
        self._shared_memory_choice = shared_memory
        self._size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        self._owner = _pid
        # Same-machine shared-memory path for CPU tensors: connected on the first CPU collective.
        self._shared: _shm.SharedMemorySum | None = None
        self._shared_ready = False
        self._calls = 0  # framed calls made (the header's sequence field)
        self._frame_cpu: Tensor | None = None
        self._frame_bytes = bytearray()
        self._frame_words: Any = None  # a float64 memoryview of _frame_bytes
        self._payload_views: dict[Any, Tensor] = {}
        self._dirty = 0  # payload values of _frame_cpu that may be non-zero
        self._pending: list[_Pending] = []
        self._pg_timeout_s: float | None = None
        #: identity -> name of the layers seen by this process, for error messages.
        self.names: dict[int, str] = {}
        #: layer state -> its first-use ordinal identity (syncbn._checks.layer_identity).
        self.layer_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.last_participants = self._size
        self.closed = False

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def process_group(self) -> Any:
        """The wrapped process group (``None``: the default group)."""
        return None if self._default else self._live()

    @property
    def key(self) -> Any:
        """The live process group object, for "already verified" bookkeeping (a re-initialised
        default group is a new object); ``None`` once it was destroyed."""
        return self._live()

    # ------------------------------------------------------------------ public API

    def all_reduce_sum(
        self, tensor: Tensor, tag: Tag | None = None, *, deferred: bool | None = None
    ) -> Tensor:
        """Sum ``tensor`` in place over the group, framed and checked, waiting at most the bound.

        Args:
            tensor: the values to sum (any shape; float64, float32, float16 or
                bfloat16); overwritten with the sum.
            tag: the call's identity (:class:`Tag`); ``None``: anonymous.
            deferred: check the summed header at the next call instead of now
                (no device-to-host synchronisation); ``None``: deferred for
                accelerator tensors outside debug mode.

        Returns:
            ``tensor``, now holding the sum.

        Raises:
            CollectiveError: the ranks made different calls (``mismatch``; every
                rank, the group stays usable), the wait exceeded the bound, or
                the transport failed (a peer died); the group is unusable after
                the latter two.

        Shape:
            any; the result has the shape of ``tensor``.
        """
        return self._framed(tensor, tag or _ANONYMOUS, present=True, host_wait=False, deferred=deferred)

    def all_reduce_sum_bounded(self, tensor: Tensor, *, host_wait: bool, tag: Tag | None = None) -> Tensor:
        """:meth:`all_reduce_sum`, optionally bounding the wait on the host for any device.

        The consistency checks use this with ``host_wait=True`` (and check the
        header at once): they read the result on the host anyway.

        Args:
            tensor: the values to sum; overwritten with the sum.
            host_wait: bound the wait on the host even for an accelerator tensor.
            tag: the call's identity; ``None``: ``Tag(0, PHASE_CHECK)``.

        Returns:
            ``tensor``, now holding the sum.
        """
        deferred = False if host_wait else None
        return self._framed(
            tensor, tag or Tag(0, PHASE_CHECK), present=True, host_wait=host_wait, deferred=deferred
        )

    def shadow_sum(self, device: torch.device | str = "cpu") -> ShadowResult | None:
        """Take part in the other ranks' next framed call without contributing (DDP ``Join``).

        Sends absent frames (flag 0, zero payload): the participants' check
        counts only them, and their sum is unchanged. The first summed frame
        tells this rank the call's tag, dtype and size, and so how many frames
        follow; this rank sends that many. A host read, whatever the device
        (a shadowing rank has nothing else to do).

        Args:
            device: where the frames live (the device the participants use:
                ``cpu`` for gloo, the rank's GPU for NCCL).

        Returns:
            What was shadowed, or ``None`` when no rank participated (every
            rank is shadowing: the joined ranks are done).

        Raises:
            CollectiveError: as :meth:`all_reduce_sum`, and when the
                participants themselves disagree.
        """
        dev = torch.device(device)
        self._enter()
        self._calls += 1
        if dev.type == "cpu" and self._shared_path() is not None:
            shared = self._shared
            assert shared is not None
            try:
                got = shared.shadow(self._bound_s())
            except _shm.SharedMemoryError as exc:
                raise self._shm_error(exc) from exc
            if got is None:
                self.last_participants = 0
                return None
            fields, k, total = got
            self.last_participants = k
            return self._shadow_result(fields, k, total)
        frame = torch.zeros(FRAME, dtype=torch.float64, device=dev)
        self._all_reduce_process_group(frame, host_wait=True)
        agreement = decode_header(frame[:HEADER].tolist(), self._size)
        if agreement.participants == 0:
            self.last_participants = 0
            return None
        if any(v is None for v in agreement.values):
            raise self._mismatch(
                "the participating ranks disagree among themselves: "
                + describe_fields(agreement.values, self.names)
            )
        fields = [int(v) for v in agreement.values if v is not None]
        count = (fields[4] << 16) | fields[5]
        total = torch.empty(count, dtype=torch.float64, device=dev)
        frames = max(1, -(-count // PAYLOAD))
        for i in range(frames):
            if i:
                frame.zero_()
                self._all_reduce_process_group(frame, host_wait=True)
            lo, hi = i * PAYLOAD, min(count, (i + 1) * PAYLOAD)
            total[lo:hi].copy_(frame[HEADER : HEADER + hi - lo])
        self.last_participants = agreement.participants
        return self._shadow_result(fields, agreement.participants, total)

    def check_pending(self) -> None:
        """Check every deferred header now (waits for their copies to land).

        Raises:
            CollectiveError: a deferred call's ranks disagreed.
        """
        pending, self._pending = self._pending, []
        for item in pending:
            if item.event is not None:
                item.event.synchronize()
            self._verify(item.summed.tolist(), item.mine, item.tag, deferred=True)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this group's CPU collectives go through shared memory (known after its first one)."""
        return self._shared is not None

    def close(self) -> None:
        """Release the shared-memory mapping and the cached buffers (the group is not usable afterwards)."""
        self.closed = True
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self._frame_cpu = None
        self._payload_views = {}
        if self._frame_words is not None:
            self._frame_words.release()
            self._frame_words = None
        self._pending.clear()

    # ------------------------------------------------------------------ framing

    def _enter(self) -> None:
        if self._owner != _pid:
            raise CollectiveError(
                f"this process (pid {_pid}) was forked from pid {self._owner} after the SyncBatchNorm "
                f"group over {self.describe()} was set up; a forked child cannot take part in its "
                "parent's collectives (it would silently join them). Initialise a process group of "
                "the child's own (or use the 'spawn' start method).",
                timed_out=False,
                waited=0.0,
                group_size=self._size,
            )
        if self.closed or self._live() is None:
            raise CollectiveError(
                f"the SyncBatchNorm group over {self.describe()} was closed (its process group was "
                "destroyed)",
                timed_out=False,
                waited=0.0,
                group_size=self._size,
            )
        if self._pending:
            self._check_ready()

    def _check_ready(self) -> None:
        pending, self._pending = self._pending, []
        for i, item in enumerate(pending):
            if item.event is not None and not item.event.query():
                self._pending.append(item)
                continue
            try:
                self._verify(item.summed.tolist(), item.mine, item.tag, deferred=True)
            except CollectiveError:
                self._pending.extend(pending[i + 1 :])
                raise

    def _shared_path(self) -> _shm.SharedMemorySum | None:
        return self._shared if self._shared_ready else self._connect_shared()

    def _framed(
        self, tensor: Tensor, tag: Tag, *, present: bool, host_wait: bool, deferred: bool | None
    ) -> Tensor:
        self._enter()
        self._calls += 1
        code = dtype_code(tensor.dtype)
        n = tensor.numel()
        if tensor.device.type == "cpu":
            shared = self._shared_path()
            if shared is not None:
                fields = header_fields(tag, code, self._calls, n, 0)
                try:
                    shared.all_reduce_sum(tensor, self._bound_s(), fields)
                except _shm.SharedMemoryError as exc:
                    raise self._shm_error(exc) from exc
                self.last_participants = shared.last_participants
                return tensor
        if deferred is None:
            deferred = tensor.device.type != "cpu" and not host_wait and not _config.debug_enabled()
        if (
            not deferred
            and present
            and n <= PAYLOAD
            and tensor.device.type == "cpu"
            and tensor.dtype in _FAST_DTYPES
            and not tensor.requires_grad
            and tensor.is_contiguous()
        ):
            return self._one_cpu_frame(tensor, tag, code, n, host_wait)
        flat = tensor.reshape(-1)
        frames = max(1, -(-n // PAYLOAD))
        for i in range(frames):
            lo, hi = i * PAYLOAD, min(n, (i + 1) * PAYLOAD)
            mine = header_fields(tag, code, self._calls, n, i)
            frame = self._frame(tensor.device, encode_header(mine, present), flat[lo:hi])
            self._all_reduce_process_group(frame, host_wait=host_wait)
            summed = frame[:HEADER]
            if deferred:
                self._defer(summed, mine, tag)
            else:
                self._verify(summed.tolist(), mine, tag, deferred=False)
            flat[lo:hi].copy_(frame[HEADER : HEADER + hi - lo])
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _one_cpu_frame(self, tensor: Tensor, tag: Tag, code: int, n: int, host_wait: bool) -> Tensor:
        """The common case, a CPU vector that fits one frame: header through a memoryview, no tensor op."""
        mine = header_fields(tag, code, self._calls, n, 0)
        head = encode_header(mine, True)
        frame, words = self._cpu_frame()
        payload = self._payload_views.get(tensor.shape)
        if payload is None:
            payload = self._payload_views[tensor.shape] = frame[HEADER : HEADER + n].view(tensor.shape)
        words[:HEADER] = array.array("d", head)
        payload.copy_(tensor)
        if self._dirty > n:
            frame[HEADER + n : HEADER + self._dirty].zero_()
        self._dirty = n
        self._all_reduce_process_group(frame, host_wait=host_wait)
        summed: list[float] = words[:HEADER].tolist()
        size = self._size
        if summed != [v * size for v in head]:  # not every rank sent this very header: find out what
            self._verify(summed, mine, tag, deferred=False)
        self.last_participants = int(summed[0])
        tensor.copy_(payload)
        return tensor

    def _cpu_frame(self) -> tuple[Tensor, Any]:
        """The reusable CPU frame and a float64 memoryview of the same memory."""
        if self._frame_cpu is None:
            self._frame_bytes = bytearray(FRAME * 8)
            self._frame_cpu = torch.frombuffer(self._frame_bytes, dtype=torch.float64)
            self._frame_words = memoryview(self._frame_bytes).cast("d")
            self._payload_views = {}
            self._dirty = 0
        assert self._frame_words is not None
        return self._frame_cpu, self._frame_words

    def _frame(self, device: torch.device, header: list[float], chunk: Tensor) -> Tensor:
        m = chunk.numel()
        if device.type == "cpu":
            frame = self._cpu_frame()[0]
            frame[:HEADER] = torch.tensor(header, dtype=torch.float64)
            frame[HEADER : HEADER + m] = chunk
            if self._dirty > m:
                frame[HEADER + m : HEADER + self._dirty].zero_()
            self._dirty = m
            return frame
        frame = torch.zeros(FRAME, dtype=torch.float64, device=device)
        head = torch.tensor(header, dtype=torch.float64)
        if device.type == "cuda":
            head = head.pin_memory()
        frame[:HEADER].copy_(head, non_blocking=True)
        frame[HEADER : HEADER + m].copy_(chunk)
        return frame

    def _defer(self, summed: Tensor, mine: list[int], tag: Tag) -> None:
        event = None
        if summed.device.type == "cuda":
            host = torch.empty(HEADER, dtype=torch.float64).pin_memory()
            host.copy_(summed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = summed.to("cpu", copy=True)
        self._pending.append(_Pending(host, event, mine, tag))
        if len(self._pending) > 64:  # never let them pile up unchecked
            self.check_pending()

    def _verify(self, summed: list[float], mine: list[int], tag: Tag, *, deferred: bool) -> None:
        agreement = decode_header(summed, self._size)
        self.last_participants = agreement.participants
        if all(v is not None for v in agreement.values):
            return
        text = mismatch_message(mine, agreement, self.names)
        if deferred:
            text = (
                f"(found by the deferred check of an earlier call, whose result has already been used) {text}"
            )
        raise self._mismatch(text)

    def _shadow_result(self, fields: list[int], k: int, total: Tensor) -> ShadowResult:
        tag = Tag((fields[0] << 16) | fields[1], fields[2] // 16)
        return ShadowResult(tag, fields[2] % 16, (fields[4] << 16) | fields[5], k, total)

    # ------------------------------------------------------------------ transports

    def _bound_s(self) -> float:
        """The wait bound: syncbn's, else the process group's own timeout."""
        bound = _config.get_timeout()
        if bound is not None:
            return bound
        if self._pg_timeout_s is None:
            self._pg_timeout_s = _pg_timeout(self.process_group)
        return self._pg_timeout_s

    def _connect_shared(self) -> _shm.SharedMemorySum | None:
        """Set up the shared-memory path (collective: every rank's first CPU collective on this group)."""
        choice = self._shared_memory_choice
        calls = self._calls

        def exchange(t: Tensor) -> Tensor:
            self._calls += 1
            return self._framed_process_group(t, Tag(0, PHASE_SETUP))

        self._shared = _shm.connect(
            self._rank,
            self._size,
            _config.shared_memory_enabled() if choice is None else choice,
            exchange,
        )
        self._calls = calls
        self._shared_ready = True
        return self._shared

    def _framed_process_group(self, tensor: Tensor, tag: Tag) -> Tensor:
        flat = tensor.reshape(-1)
        n = flat.numel()
        code = dtype_code(tensor.dtype)
        for i in range(max(1, -(-n // PAYLOAD))):
            lo, hi = i * PAYLOAD, min(n, (i + 1) * PAYLOAD)
            mine = header_fields(tag, code, self._calls, n, i)
            frame = self._frame(tensor.device, encode_header(mine, True), flat[lo:hi])
            self._all_reduce_process_group(frame, host_wait=True)
            self._verify(frame[:HEADER].tolist(), mine, tag, deferred=False)
            flat[lo:hi].copy_(frame[HEADER : HEADER + hi - lo])
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _all_reduce_process_group(self, tensor: Tensor, *, host_wait: bool) -> Tensor:
        delta = _config.timeout_delta()
        if delta is None or not (host_wait or tensor.device.type == "cpu" or _config.debug_enabled()):
            start = time.monotonic()
            try:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                raise self._error(exc, time.monotonic() - start, None) from exc
            return tensor
        start = time.monotonic()
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            finished = work.wait(timeout=delta)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(exc, time.monotonic() - start, _config.get_timeout()) from exc
        if finished is False:  # some backends report a timeout by returning False
            raise self._error(None, time.monotonic() - start, _config.get_timeout())
        return tensor

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
        timed_out = exc is None or "timed out" in text.lower() or "timeout" in text.lower()
        if timeout is not None and waited >= 0.95 * timeout:
            timed_out = True
        if failed:
            timed_out = False
        if timed_out:
            bound = "" if timeout is None else f" (bound: {timeout:g} s{self._bound_source()})"
            head = (
                f"waited {waited:.1f} s{bound} for the all_reduce over {self.describe()}, "
                "and not every rank arrived. "
            )
            causes = _LIKELY_CAUSES
        elif failed:
            head = f"the all_reduce over {self.describe()} failed after {waited:.1f} s: {failed}. "
            causes = "Check the other ranks' logs for the first error."
        else:
            head = (
                f"the all_reduce over {self.describe()} failed after {waited:.1f} s: "
                "a peer process most likely died or closed its connection. "
            )
            causes = "Check the other ranks' logs for the first error."
        message = f"{head}{causes}{_AFTER_FAILURE}"
        if text and not failed:
            message += f" [{text.splitlines()[0][:300]}]"
        return CollectiveError(
            message, timed_out=timed_out, waited=waited, group_size=self._size, detail=text
        )

    def _bound_source(self) -> str:
        if _config.get_timeout() is None:
            return ": the process group's timeout, SYNCBN_TIMEOUT being none"
        return ": SYNCBN_TIMEOUT/syncbn.set_timeout"

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

    def __repr__(self) -> str:
        return f"ProcessGroupSum(rank={self._rank}, size={self._size})"


def group_ranks(process_group: Any) -> list[int]:
    """Global ranks of the members of ``process_group`` (``None``: the default group)."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(process_group))


class ProcessGroupRef:
    """A picklable stand-in for a process group, naming it by its global ranks.

    Modules store one in place of an explicit process group when they are
    pickled (``torch.save``); :func:`resolve` finds the live group with the same
    ranks again when the loaded module first synchronizes.

    Args:
        ranks: the global ranks of the group's members, in group-rank order.
    """

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)

    def lookup(self) -> Any:
        """The live process group with these ranks.

        Raises:
            RuntimeError: when no such group exists in this job.
        """
        if self.ranks == list(range(dist.get_world_size())):
            return None
        world = dist.distributed_c10d._world
        for group, mapping in world.pg_group_ranks.items():
            ordered = sorted(mapping, key=mapping.__getitem__)
            if ordered == self.ranks:
                return group
        raise RuntimeError(
            f"syncbn: this module was saved with a process group of global ranks {self.ranks}, "
            "and no such group exists in this job; create it with torch.distributed.new_group "
            "and assign it to module.process_group"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessGroupRef) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessGroupRef(ranks={self.ranks})"


def resolve(process_group: Any) -> SumGroup | None:
    """The group a training call synchronizes over, or ``None`` to run locally.

    Args:
        process_group: a ``torch.distributed`` process group, a
            :class:`ProcessGroupRef`, a ready :class:`SumGroup`, or ``None`` for
            the default group.

    Returns:
        ``None`` when ``torch.distributed`` is unavailable or not initialised,
        or the group has a single member: plain batch norm is then exact.
        Otherwise a :class:`SumGroup`.
    """
    # Concrete types first: a runtime Protocol check costs tens of microseconds.
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, ProcessGroupRef)):
        if type(process_group) in _sum_group_types or isinstance(process_group, SumGroup):
            _sum_group_types.add(type(process_group))
            return process_group if process_group.size > 1 else None
    if not (dist.is_available() and dist.is_initialized()):
        if _resolved:
            forget_destroyed()
        return None
    if isinstance(process_group, ProcessGroupRef):
        process_group = process_group.lookup()
    live = dist.group.WORLD if process_group is None else process_group
    hit = _resolved.get(id(live))
    if hit is not None and hit[0]() is live:
        return hit[1]
    forget_destroyed()
    group = ProcessGroupSum(process_group) if dist.get_world_size(process_group) > 1 else None
    _resolved[id(live)] = (weakref.ref(live), group)
    return group


def forget_destroyed() -> int:
    """Drop (and close) the cached groups of process groups that no longer exist.

    Runs by itself whenever :func:`resolve` meets a group it has not seen, or
    ``torch.distributed`` is no longer initialised: after
    ``destroy_process_group()`` nothing of the old group survives in syncbn.

    Returns:
        How many cached groups were dropped.
    """
    live: set[int] = set()
    if dist.is_available() and dist.is_initialized():
        live = {id(g) for g in dist.distributed_c10d._world.pg_map}
    dropped = 0
    for key, (ref, group) in list(_resolved.items()):
        target = ref()
        if target is None or id(target) not in live:
            del _resolved[key]
            if group is not None:
                group.close()
            dropped += 1
    return dropped


# Classes whose instances passed the SumGroup protocol check once.
_sum_group_types: set[type] = set()

# Live process group's id -> (a weak reference to it, its ProcessGroupSum or None for a group of one).
_resolved: dict[int, tuple[weakref.ref[Any], ProcessGroupSum | None]] = {}


def to_picklable(process_group: Any) -> Any:
    """Replace a live process group by a :class:`ProcessGroupRef` for pickling."""
    if process_group is None or isinstance(process_group, ProcessGroupRef):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return ProcessGroupRef(group_ranks(process_group))
    return process_group


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialised."""
    return dist.is_available() and dist.is_initialized()
