"""The per-call exchange of :mod:`syncbn._shm`: layout, rounds, checks (docs/internals/transports.md)."""

from __future__ import annotations

import contextlib
import mmap
import operator
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._wait import WITHDRAWN as _WITHDRAWN
from ._wait import Waiter, WaitFailure, attach
from ._wait import alive as _alive

_LINE = 64  # bytes per rank's flag: one cache line each
_CAPACITY = 64 * 1024  # bytes per slot: float64 vectors of up to 8,192 values (C <= 4095)


class SharedMemoryError(RuntimeError):
    """The shared-memory all_reduce failed: a timeout, a peer that died, or mismatched calls
    (``mismatch``: the segment stays usable; ``ranks``: each rank's header fields, ``None`` shadowing)."""

    def __init__(
        self, message: str, *, timed_out: bool = False, waited: float = 0.0, mismatch: bool = False
    ) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.waited = waited
        self.mismatch = mismatch
        self.ranks: list[list[int] | None] = []


_SLOT = _LINE + _CAPACITY  # metadata line + data
DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}


def _header_size(world_size: int) -> int:
    return (_LINE * (world_size + 1) + 4095) // 4096 * 4096


def _segment_size(world_size: int) -> int:
    return _header_size(world_size) + 2 * world_size * _SLOT


# Why a rank withdrew: written next to its flag before the flag turns -1.
_REASONS = {
    1: "it timed out waiting for the others",
    2: "it found a peer process dead",
    3: "it found a slot's data not matching its checksum",
    4: "it failed",
}
_META_ROUND, _META_PRESENT, _META_LAYER, _META_ID, _META_SIZE, _META_CRC, _META_COUNT = range(7)
_AGREED = operator.itemgetter(_META_LAYER, _META_ID, _META_SIZE, _META_COUNT)  # the participants' header


def _unpack(line: Sequence[int]) -> list[int]:
    """The seven 16-bit header fields from a metadata line (packed two, two and three to a word)."""
    layer, ident, size = line[_META_LAYER], line[_META_ID], line[_META_SIZE]
    halves = [ident >> 16, ident, size >> 32, size >> 16, size]
    return [layer >> 16, layer & 0xFFFF, *(h & 0xFFFF for h in halves)]


class _Plan(NamedTuple):
    """What a round of one size touches, made once per (buffer, dtype, values)."""

    own: Tensor  # this rank's slot, as the tensor the chunk is copied into
    mine: memoryview  # the same bytes, for their checksum
    pairs: list[tuple[memoryview, memoryview]]  # per rank: (its private copy, its slot)
    copy: Tensor  # the private copies, (world_size, values)
    rows: tuple[Tensor, Tensor] | None  # with two ranks, the two rows of ``copy``


_MAX_PLANS = 1024
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class SharedMemorySum:
    """Sum small CPU tensors across the ranks of one machine through a mapped segment (:func:`connect`)."""

    def __init__(self, segment: mmap.mmap, rank: int, world_size: int, pids: list[int]) -> None:
        self._segment = segment
        self._rank = rank
        self._size = world_size
        self._pids = pids
        self._raw = memoryview(segment)
        self._flags = self._raw.cast("q")  # int64 words; rank r's flag at word (r + 1) * 8
        self._flag_index = [(r + 1) * (_LINE // 8) for r in range(world_size)]
        self._own_flag = self._flag_index[rank]
        self._scratch_buffer = bytearray(world_size * _CAPACITY)
        self._scratch_bytes = memoryview(self._scratch_buffer)
        self._seq = 0
        # The wait: in the kernel (futex) where it works, chosen once; else spin and sleep in steps.
        futex = attach(segment, self._own_flag * 8)
        self._waiter = Waiter(self._flags, self._flag_index, rank, pids, futex)
        self.spin = self._waiter.spin
        self.broken = False
        self.last_participants = world_size
        # Per buffer, precomputed once: every rank's metadata word index and data byte offset.
        header = _header_size(world_size)
        slots = [[header + (b * world_size + r) * _SLOT for r in range(world_size)] for b in (0, 1)]
        self._metas = [[offset // 8 for offset in row] for row in slots]
        self._starts = [[offset + _LINE for offset in row] for row in slots]
        # (buffer, dtype, values) -> everything a round of that size touches, built once (_plan).
        self._plans: dict[tuple[int, torch.dtype, int], _Plan] = {}
        self._plan_views: list[memoryview] = []  # the plans' views of the segment, released at close

    def _plan(self, buffer: int, dtype: torch.dtype, m: int) -> _Plan:
        """Views for a round of ``m`` values of ``dtype`` in ``buffer``, made once and kept."""
        if len(self._plans) >= _MAX_PLANS:
            self._release_plans()
        item = dtype.itemsize
        nbytes = m * item
        starts, raw, scratch = self._starts[buffer], self._raw, self._scratch_bytes
        slots = [raw[a : a + nbytes] for a in starts]
        copies = [scratch[r * _CAPACITY : r * _CAPACITY + nbytes] for r in range(self._size)]
        self._plan_views += slots + copies
        own = torch.frombuffer(self._segment, dtype=dtype, offset=starts[self._rank], count=_CAPACITY // item)
        copy = torch.frombuffer(self._scratch_buffer, dtype=dtype).view(self._size, _CAPACITY // item)[:, :m]
        rows = (copy[0], copy[1]) if self._size == 2 else None
        plan = _Plan(own[:m], slots[self._rank], list(zip(copies, slots)), copy, rows)
        self._plans[(buffer, dtype, m)] = plan
        return plan

    def _release_plans(self) -> None:
        self._plans.clear()
        for view in self._plan_views:
            view.release()
        self._plan_views.clear()

    def all_reduce_sum(self, tensor: Tensor, timeout: float, fields: list[int]) -> Tensor:
        """Sum ``tensor`` (any size) in place over the group, framed by the seven header ``fields``;
        :class:`SharedMemoryError` on any failure (``broken`` afterwards unless ``mismatch``)."""
        n = tensor.numel()
        per = _CAPACITY // tensor.element_size()
        if n <= per and tensor.dim() == 1 and tensor.is_contiguous():
            self._round(tensor, fields, timeout)
            return tensor
        flat = tensor.reshape(-1)
        fields = list(fields)
        for i in range(max(1, -(-n // per))):
            fields[6] = i
            self._round(flat[i * per : (i + 1) * per], fields, timeout)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def shadow(self, timeout: float) -> tuple[list[int], int, Tensor] | None:
        """Shadow the next call: ``(fields, participants, float64 sum)``; ``None``: no rank took part."""
        first = self._round(None, [0] * 7, timeout)
        if first is None:
            return None
        fields, k, total = first
        parts = [total]
        per = _CAPACITY // _CODE_DTYPES.get(fields[2] % 16, torch.float64).itemsize
        for _ in range(1, -(-((fields[4] << 16) | fields[5]) // per)):
            got = self._round(None, [0] * 7, timeout)
            if got is None:
                raise self._fail("the participants stopped in the middle of a call")
            parts.append(got[2])
        return fields, k, torch.cat(parts)

    def _round(
        self, chunk: Tensor | None, fields: list[int], timeout: float
    ) -> tuple[list[int], int, Tensor] | None:
        """One slot's exchange; ``chunk`` ``None``: absent (shadowing), then what the participants summed."""
        if self.broken:
            raise SharedMemoryError("the shared-memory group is unusable after an earlier failure")
        # The hot path: views are cached; the only tensor operations are the copy in and the sum.
        seq = self._seq = self._seq + 1
        buffer = seq & 1
        words = self._flags
        metas = self._metas[buffer]
        meta = metas[self._rank]
        if chunk is not None:
            m = chunk.numel()
            plan = self._plans.get((buffer, chunk.dtype, m)) or self._plan(buffer, chunk.dtype, m)
            plan.own.copy_(chunk)
            words[meta + _META_CRC] = zlib.crc32(plan.mine)
            words[meta + _META_COUNT] = m
        words[meta + _META_PRESENT] = chunk is not None
        words[meta + _META_LAYER] = (fields[0] << 16) | fields[1]
        words[meta + _META_ID] = (fields[2] << 16) | fields[3]
        words[meta + _META_SIZE] = (((fields[4] << 16) | fields[5]) << 16) | fields[6]
        words[meta + _META_ROUND] = seq
        words[self._own_flag] = seq
        waiter = self._waiter
        waiter.arrived()
        try:
            waiter.wait(seq, timeout)
        except WaitFailure as failure:
            raise self._failed_wait(failure) from None
        lines = [words[i : i + 7].tolist() for i in metas]
        waiter.recheck(seq)
        taking = [r for r, line in enumerate(lines) if line[_META_PRESENT]]
        if not taking:
            return None
        agreed = _AGREED(lines[taking[0]])
        for line in lines:
            if line[_META_ROUND] != seq or (line[_META_PRESENT] and _AGREED(line) != agreed):
                raise self._mismatch(lines)
        if chunk is None:  # the participants' dtype and size, from their line
            fields = _unpack(lines[taking[0]])
            dtype, m = _CODE_DTYPES.get(fields[2] % 16, torch.float64), lines[taking[0]][_META_COUNT]
            plan = self._plans.get((buffer, dtype, m)) or self._plan(buffer, dtype, m)
        # A private copy of every slot: what is checked is what is summed.
        bad = []
        for r, (copied, slot) in enumerate(plan.pairs):
            copied[:] = slot
            if lines[r][_META_PRESENT] and zlib.crc32(copied) != lines[r][_META_CRC]:
                bad.append(r)
        if bad:
            raise self._fail(
                f"the data in the shared-memory slot of rank(s) {bad} does not match its checksum (a torn "
                "or foreign write into the segment)",
                reason=3,
            )
        for r, i in enumerate(self._flag_index):
            if words[i] == _WITHDRAWN:
                raise self._withdrawn(r, 0.0)
        k = self.last_participants = len(taking)
        if chunk is None:
            return fields, k, plan.copy[taking].sum(0, dtype=torch.float64)
        if k < self._size:
            chunk.copy_(plan.copy[taking].sum(0))
        elif plan.rows is not None:  # two ranks: one addition, as gloo makes it
            torch.add(plan.rows[0], plan.rows[1], out=chunk)
        else:
            torch.sum(plan.copy, 0, out=chunk)
        return None

    def _mismatch(self, lines: list[list[int]]) -> SharedMemoryError:
        error = SharedMemoryError("the ranks made different collectives at the same point", mismatch=True)
        error.ranks = [_unpack(line) if line[_META_PRESENT] else None for line in lines]
        return error

    def _fail(
        self, message: str, *, timed_out: bool = False, waited: float = 0.0, reason: int = 4
    ) -> SharedMemoryError:
        """Withdraw this rank (late peers then fail too) and build the error."""
        self.broken = True
        self._flags[self._own_flag + 1] = reason
        self._flags[self._own_flag] = _WITHDRAWN
        self._waiter.withdrew()
        return SharedMemoryError(message, timed_out=timed_out, waited=waited)

    def _withdrawn(self, rank: int, waited: float) -> SharedMemoryError:
        # A peer that withdrew because a process died: name the dead process, as the rank that found it does.
        dead = [r for r, pid in enumerate(self._pids) if r != self._rank and not _alive(pid)]
        if dead:
            return self._died(
                dead, waited, f"; rank {rank} of the group found it first and gave up on this collective"
            )
        why = _REASONS.get(self._flags[self._flag_index[rank] + 1], "it failed")
        return self._fail(
            f"rank {rank} of the group gave up on this collective ({why}); this rank does not complete "
            "it with the data left behind",
            waited=waited,
        )

    def _died(self, ranks: list[int], waited: float, found: str = "") -> SharedMemoryError:
        pids = [self._pids[r] for r in ranks]
        return self._fail(
            f"the process of rank(s) {ranks} of the group died (pid {pids}){found}", waited=waited, reason=2
        )

    def _failed_wait(self, failure: WaitFailure) -> SharedMemoryError:
        ranks, waited = failure.ranks, failure.waited
        if failure.kind == "withdrawn":
            return self._withdrawn(ranks[0], waited)
        if failure.kind == "timeout":
            return self._fail(
                f"rank {ranks[0]} of the group did not arrive", timed_out=True, waited=waited, reason=1
            )
        return self._died(ranks, waited)

    def close(self) -> None:
        """Release the mapping (views made from it must no longer be used)."""
        self._release_plans()
        self._scratch_bytes.release()
        self._flags.release()
        self._raw.release()
        with contextlib.suppress(BufferError):  # a tensor view is alive: the mapping goes with the process
            self._segment.close()
