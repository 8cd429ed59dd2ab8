"""Frames over the process group (a base of ``ProcessGroupSum``): built, summed within the bound,
their headers checked at once or deferred. See docs/internals/groups.md."""

from __future__ import annotations

import array
import time
import warnings
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _config
from . import _own
from ._errors import CollectiveError, Reporting
from ._frame import (
    FRAME,
    HEADER,
    PAYLOAD,
    SEQUENCE,
    Tag,
    decode_header,
    describe_fields,
    dtype_code,
    encode_header,
    header_fields,
    mismatch_message,
)


class _Pending(NamedTuple):
    """A deferred header check: the summed header on its way to (or in) host memory."""

    summed: Tensor
    event: Any
    mine: list[int]


class FramedTransport(Reporting):
    """Framed ``all_reduce`` over the process group."""

    def __init__(self, process_group: Any, own_group: bool) -> None:
        super().__init__(process_group)
        self._calls = 0  # framed calls made (the header's sequence field)
        self._frame_cpu: Tensor | None = None
        self._frame_bytes = bytearray()
        self._frame_words: Any = None  # a float64 memoryview of _frame_bytes
        self._payload_views: dict[Any, Tensor] = {}
        self._headers: dict[
            tuple[Tag, torch.dtype, int], tuple[list[int], array.array[float], list[float]]
        ] = {}
        self._dirty = 0  # payload values of _frame_cpu that may be non-zero
        self._pending: list[_Pending] = []
        self._own_group = own_group
        self._wire_ref: weakref.ref[Any] | None = None  # the group carrying the CPU frames (_cpu_wire)
        self._release: Any = None  # releases it (syncbn.groups._own.release) when this group goes
        self._wire_ready = False
        self._wire_timeout: float | None = None
        self._wire_stuck: float | None = None  # a bound this torch could not carry to the wire (warned)
        self.last_participants = self._size

    def check_pending(self, *, wait: bool = True) -> None:
        """Check the deferred headers (``wait``: every one, else those landed); raises ``CollectiveError``."""
        pending, self._pending = self._pending, []
        for i, item in enumerate(pending):
            if item.event is not None and not wait and not item.event.query():
                self._pending.append(item)
                continue
            if item.event is not None:
                item.event.synchronize()
            try:
                self._verify(item.summed.tolist(), item.mine, deferred=True)
            except CollectiveError:
                self._pending.extend(pending[i + 1 :])
                raise

    def _prepared(
        self, tag: Tag, dtype: torch.dtype, n: int
    ) -> tuple[list[int], array.array[float], list[float]]:
        """A call site's header fields, their encoding and every rank's sum of it, made once per
        ``(tag, dtype, size)``: a call writes only its sequence number into them."""
        key = (tag, dtype, n)
        prepared = self._headers.get(key)
        if prepared is None:
            if len(self._headers) > 4096:  # call sites are few; never let odd callers grow it
                self._headers.clear()
            mine = header_fields(tag, dtype_code(dtype), 0, n, 0)
            head = array.array("d", encode_header(mine, True))
            prepared = self._headers[key] = (mine, head, [v * self._size for v in head])
        return prepared

    def _one_cpu_frame(self, tensor: Tensor, tag: Tag, host_wait: bool) -> Tensor:
        """The common case, a CPU vector that fits one frame: header through a memoryview, no tensor op."""
        n = tensor.numel()
        mine, head, agreed = self._prepared(tag, tensor.dtype, n)
        sequence = self._calls & 0xFFFF
        mine[SEQUENCE] = sequence
        head[1 + 2 * SEQUENCE], head[2 + 2 * SEQUENCE] = float(sequence), float(sequence * sequence)
        agreed[1 + 2 * SEQUENCE] = head[1 + 2 * SEQUENCE] * self._size
        agreed[2 + 2 * SEQUENCE] = head[2 + 2 * SEQUENCE] * self._size
        frame, words = self._cpu_frame()
        payload = self._payload_views.get(tensor.shape)
        if payload is None:
            payload = self._payload_views[tensor.shape] = frame[HEADER : HEADER + n].view(tensor.shape)
        words[:HEADER] = head
        payload.copy_(tensor)
        if self._dirty > n:
            frame[HEADER + n : HEADER + self._dirty].zero_()
        self._dirty = n
        self._all_reduce_process_group(frame, host_wait=host_wait)
        summed: list[float] = words[:HEADER].tolist()
        if summed != agreed:  # not every rank sent this very header: find out what
            self._verify(summed, list(mine), deferred=False)
        self.last_participants = int(summed[0])
        tensor.copy_(payload)
        return tensor

    def _cpu_frame(self) -> tuple[Tensor, Any]:
        """The reusable CPU frame and a float64 memoryview of it."""
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

    def _defer(self, summed: Tensor, mine: list[int]) -> None:
        event = None
        if summed.device.type == "cuda":
            host = torch.empty(HEADER, dtype=torch.float64).pin_memory()
            host.copy_(summed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = summed.to("cpu", copy=True)
        self._pending.append(_Pending(host, event, mine))
        if len(self._pending) > 64:  # never let them pile up unchecked
            self.check_pending()

    def _verify(self, summed: list[float], mine: list[int], *, deferred: bool) -> None:
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

    def _shadow_process_group(self, dev: torch.device) -> tuple[list[int], int, Tensor] | None:
        """:meth:`ProcessGroupSum.shadow_sum` on the process group: ``(fields, participants, sum)``."""
        if dev.type == "cpu":  # the reusable frame: gloo is only ever handed tensors that outlive it
            frame = self._cpu_frame()[0]
            self._dirty = PAYLOAD
        else:
            frame = torch.empty(FRAME, dtype=torch.float64, device=dev)
        frame.zero_()  # an absent frame: flag 0, zero payload
        self._all_reduce_process_group(frame, host_wait=True)
        agreement = decode_header(frame[:HEADER].tolist(), self._size)
        if agreement.participants == 0:
            return None
        if any(v is None for v in agreement.values):
            raise self._mismatch(
                "the participating ranks disagree among themselves: "
                + describe_fields(agreement.values, self.names)
            )
        fields = [int(v) for v in agreement.values if v is not None]
        count = (fields[4] << 16) | fields[5]
        total = torch.empty(count, dtype=torch.float64, device=dev)
        for i in range(frame_count(count)):
            if i:
                frame.zero_()
                self._all_reduce_process_group(frame, host_wait=True)
            lo, hi = i * PAYLOAD, min(count, (i + 1) * PAYLOAD)
            total[lo:hi].copy_(frame[HEADER : HEADER + hi - lo])
        return fields, agreement.participants, total

    def _frames(self, tensor: Tensor, tag: Tag, *, host_wait: bool, deferred: bool) -> Tensor:
        """Sum ``tensor`` in place over the process group, frame by frame, each header checked or deferred."""
        flat = tensor.reshape(-1)
        n = flat.numel()
        code = dtype_code(tensor.dtype)
        for i in range(frame_count(n)):
            lo, hi = i * PAYLOAD, min(n, (i + 1) * PAYLOAD)
            mine = header_fields(tag, code, self._calls, n, i)
            frame = self._frame(tensor.device, encode_header(mine, True), flat[lo:hi])
            self._all_reduce_process_group(frame, host_wait=host_wait)
            if deferred:
                self._defer(frame[:HEADER], mine)
            else:
                self._verify(frame[:HEADER].tolist(), mine, deferred=False)
            flat[lo:hi].copy_(frame[HEADER : HEADER + hi - lo])
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _cpu_wire(self) -> Any:
        """The group carrying the CPU frames (``None``: the process group, during set-up), the
        current bound carried over to it (or warned about where torch cannot)."""
        if not self._wire_ready:
            if not self._own_group:
                return None  # set-up: over the process group
            group, bound = self.process_group, self._bound_s()
            # Its timeout is now the bound, or (a torch that cannot change it) what it was made with.
            self._wire_timeout = bound if _own.set_timeout(group, bound) else _own.timeout_s(group)
            self._attach_wire(weakref.ref(group), bound)
        wire = None if self._wire_ref is None else self._wire_ref()
        if wire is not None and self._wire_timeout is not None:
            now = self._bound_s()  # syncbn's bound, else the process group's timeout
            if now != self._wire_timeout:
                if _own.set_timeout(wire, now):
                    self._wire_timeout = now  # a later syncbn.set_timeout, carried over to gloo
                elif now != self._wire_stuck:
                    self._wire_stuck = now
                    warnings.warn(_stuck_timeout(self._wire_timeout, now, self.describe()), stacklevel=4)
        return wire

    def _make_wire(self) -> None:
        """Make the wire for the CPU frames (collective, right after set-up; an ``own_group`` is its own)."""
        if self._wire_ready or self._own_group:
            return
        bound = self._bound_s()
        start = time.monotonic()
        try:
            ref = _own.make(self.process_group, bound)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(exc, time.monotonic() - start, bound) from exc
        self._wire_timeout = bound
        self._attach_wire(ref, bound)

    def _attach_wire(self, ref: weakref.ref[Any] | None, bound: float) -> None:
        wire = None if ref is None else ref()
        if wire is not None:
            self._release = weakref.finalize(self, _own.release, _own.adopt(wire), bound + 1.0)
        _own.keep(wire, self._cpu_frame()[0])  # the frame outlives the group (teardown)
        self._wire_ref = ref
        self._wire_ready = True

    def _all_reduce_process_group(self, tensor: Tensor, *, host_wait: bool) -> None:
        wire = self._cpu_wire() if tensor.device.type == "cpu" else None
        group = self.process_group if wire is None else wire
        delta = _config.timeout_delta()
        # On an accelerator the wait is left to the device stream unless the host must bound it.
        bounded = delta is not None and (host_wait or tensor.device.type == "cpu" or _config.debug_enabled())
        start = time.monotonic()
        work = None
        try:
            work = start_all_reduce(tensor, group)
            finished = work.wait(timeout=delta) if bounded else work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            if not bounded:
                raise self._error(exc, time.monotonic() - start, None) from exc
            _own.abandon(work, tensor)
            raise self._error(exc, time.monotonic() - start, _config.get_timeout()) from exc
        if bounded and finished is False:  # some backends report a timeout by returning False
            _own.abandon(work, tensor)
            raise self._error(None, time.monotonic() - start, _config.get_timeout())


def _stuck_timeout(kept: float, wanted: float, group: str) -> str:
    return (
        f"syncbn: the wait bound changed to {wanted:g} s after the set-up of the group over {group}, "
        f"and torch {torch.__version__} cannot change the timeout of syncbn's gloo group for it "
        "(gloo takes a changed timeout from torch 2.13 on). The wait on this rank now "
        f"ends at {wanted:g} s, but gloo still gives up on the group's collectives at "
        f"{kept:g} s, the bound when the group was set up: "
        + (
            f"a collective that takes longer than {kept:g} s fails then (a CollectiveError), "
            f"before the new bound"
            if wanted > kept
            else f"a collective abandoned at {wanted:g} s stays on gloo's thread until {kept:g} s "
            "(destroying the group or exiting waits for it)"
        )
        + ". Call syncbn.set_timeout (or set SYNCBN_TIMEOUT) before the first training step, or "
        "upgrade torch."
    )


def frame_count(n: int) -> int:
    """Frames that carry ``n`` values (at least one)."""
    return max(1, -(-n // PAYLOAD))


def start_all_reduce(tensor: Tensor, group: Any) -> Any:
    """Start the summing ``all_reduce`` of ``tensor`` over ``group`` (a process group or a wire); its work."""
    if isinstance(group, dist.ProcessGroupGloo):  # syncbn's own wire: not registered with torch
        options: Any = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        return group.allreduce([tensor], options)  # type: ignore[attr-defined]
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
