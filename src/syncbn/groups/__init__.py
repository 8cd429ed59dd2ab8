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
its work handle with that bound. A group's set-up (its first CPU collective: the
shared-memory agreement) runs over the process group itself, whose connections already
exist, so a peer that died before its first call is found at once (its connections are
closed), not at the bound. Right after it, where shared memory is not used, CPU frames get a
gloo *wire* of the group's own (``_own``): a bare gloo backend whose members meet in the
job's store under a key of syncbn's own (the group's name and a count of wires made over it),
with the bound as its timeout, so that gloo itself gives up at the bound too (a bounded wait
alone leaves the abandoned collective on gloo's thread until the process group's timeout, and
destroy and exit wait for it); it also keeps syncbn's frames apart from DDP's collectives.
Only the group's members take part (``torch.distributed.new_group`` would need every rank of
the job, or name the group after a count of groups that differs between ranks of overlapping
groups), so overlapping user groups reached in different orders on different ranks never wait
for each other. On an accelerator a bounded
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
and refuses use once that group is gone. syncbn's own wires are held by ``_own``
alone (never registered with ``torch.distributed``), with the frames handed to
them, and destroyed in order (abandoned works,
the group, then its frames: gloo's worker thread never has to free a Python
object while the main thread joins it) when their ``ProcessGroupSum`` closes or
is collected, and at exit. :func:`resolve` caches one per live
process group and drops (and closes) those of destroyed groups, so
``destroy_process_group()`` + ``init_process_group()`` cycles keep file
descriptors and mappings flat.

An explicit process group cannot be pickled; :class:`ProcessGroupRef` stands in
for it inside a saved module and is looked up again, by its global ranks, on
first use after loading.

Modules
-------
This package is the seam; its parts: ``_frame`` (the header fields, their encoding and check),
``_errors`` (:class:`CollectiveError`, the group in words), ``_transport`` (frames over the
process group), ``_own`` (syncbn's own groups: made with the bound, destroyed in order), ``_ddp``
(the DDP wrappers of the process: a plain ``Join([ddp])`` refused, DDP's own bound warned about),
``_sum`` (:class:`ProcessGroupSum`: transport choice, lifecycle), ``_refs``
(:class:`ProcessGroupRef`), ``_resolve`` (:func:`resolve` and its cache) and ``_subgroup``
(:func:`subgroup`: groups of k ranks or of one machine, made safely on every rank). Import from
``syncbn.groups``, not from the parts.
"""

from __future__ import annotations

import torch.distributed as dist  # noqa: F401 - syncbn.groups.dist: the tests patch its all_reduce

# Beyond __all__, the seam also re-exports the helpers that syncbn's tools and tests use.
from . import _ddp, _own, _transport  # noqa: F401 - syncbn.join and the tests use them
from ._ddp import PlainJoinError, UnboundedStepWarning
from ._errors import CollectiveError
from ._frame import (  # noqa: F401
    DTYPE_CODES,
    FIELDS,
    FRAME,
    HEADER,
    PAYLOAD,
    PHASE_BACKWARD,
    PHASE_CHECK,
    PHASE_FORWARD,
    PHASE_NAMES,
    PHASE_OTHER,
    PHASE_SETUP,
    Agreement,
    ShadowResult,
    SumGroup,
    Tag,
    decode_header,
    describe_fields,
    differing,
    dtype_code,
    encode_header,
    header_fields,
    mismatch_message,
)
from ._refs import ProcessGroupRef, group_ranks
from ._resolve import (  # noqa: F401
    _resolved,
    _sum_group_types,
    forget_destroyed,
    is_initialized,
    resolve,
    to_picklable,
)
from ._subgroup import NODE, group_for, subgroup  # noqa: F401 - group_for: syncbn.convert
from ._sum import ProcessGroupSum

_ddp.install()  # records DDP wrappers as they are built (see _ddp)

__all__ = [
    "SumGroup",
    "ProcessGroupSum",
    "ProcessGroupRef",
    "CollectiveError",
    "PlainJoinError",
    "UnboundedStepWarning",
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
    "subgroup",
    "NODE",
]
