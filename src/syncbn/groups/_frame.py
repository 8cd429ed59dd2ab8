"""The frame format: constants, :class:`Tag`, the header's encoding and check (docs/internals/groups.md)."""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from .. import _shm

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
#: Index of the call's sequence number in :data:`FIELDS` (the one field a call site's calls change).
SEQUENCE = FIELDS.index("sequence")
#: float64 values of the header: the flag and (p*f, p*f^2) for each field.
HEADER = 1 + 2 * len(FIELDS)
#: float64 values of one frame on the process-group transport.
FRAME = 4112
#: payload values per frame.
PAYLOAD = FRAME - HEADER


class Tag(NamedTuple):
    """The caller's part of a framed call's identity.

    Args:
        layer: a 32-bit identity, equal on every rank for the same layer
            (``0``: an anonymous call site; then phase, dtype and size identify it).
        phase: one of the ``PHASE_*`` constants.
    """

    layer: int = 0
    phase: int = PHASE_OTHER


ANONYMOUS = Tag()
FAST_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class ShadowResult(NamedTuple):
    """What :meth:`ProcessGroupSum.shadow_sum` learnt about the call it shadowed.

    Attributes:
        tag: the participants' :class:`Tag`.
        dtype_code: the participants' payload dtype (:data:`DTYPE_CODES`).
        numel: number of values the participants summed.
        participants: how many ranks contributed (``p = 1``).
        total: the participants' sum, float64, ``numel`` values.
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
    names = (str(dtype).replace("torch.", "") for dtype, c in DTYPE_CODES.items() if c == code)
    return next(names, "another dtype")


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
    return [1.0] + [float(v) for f in fields for v in (f, f * f)]


class Agreement(NamedTuple):
    participants: int
    values: list[int | None]  # the agreed value of each field, None where ranks differ
    pairs: list[tuple[int, int] | None]  # in a group of two, both values where they differ


def decode_header(summed: list[float], group_size: int) -> Agreement:
    """Check a summed header: which fields all participating ranks sent alike."""
    k = int(round(summed[0]))
    values: list[int | None] = []
    pairs: list[tuple[int, int] | None] = []
    for i in range(len(FIELDS)):
        s1, s2 = (int(round(v)) for v in summed[1 + 2 * i : 3 + 2 * i])
        agreed = k > 0 and k * s2 == s1 * s1 and s1 % k == 0
        values.append(s1 // k if agreed else None)
        pair = None
        if k == 2 and not agreed:
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
        other = [  # where the fields agree, this rank's value is the agreed one
            value if pair is None else (pair[1] if pair[0] == mine[i] else pair[0])
            for i, (value, pair) in enumerate(zip(agreement.values, agreement.pairs))
        ]
        text += f" (the other rank sent {describe_fields(other, names)})"
    return text


@runtime_checkable
class SumGroup(Protocol):
    """A set of peers that can sum a tensor elementwise among themselves.

    Optional capabilities, read with ``getattr`` (absent: ``False``): ``framed``, the group frames
    its calls and ``all_reduce_sum(tensor, tag, *, deferred)`` takes the call's :class:`Tag` (the
    engine passes the layer's identity and phase); ``replicas``, the members are one process's
    ``nn.DataParallel`` replicas (their moments are this process's alone).
    """

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
