"""The communication seam: "sum these tensors across my group", framed.

A :class:`SumGroup` sums a small vector over every member of a group; :class:`ProcessGroupSum` wraps a
``torch.distributed`` process group (or, for the CPU ranks of one machine, shared memory); :func:`resolve`
returns ``None`` where plain batch norm is exact. Every collective is framed (:data:`FIELDS`), so ranks at
different calls raise :class:`CollectiveError` (``mismatch=True``) together. How, and the parts:
docs/internals/groups.md (user side: docs/robustness.md). Import from ``syncbn.groups``, not from the parts.
"""

from __future__ import annotations

import torch.distributed as dist  # noqa: F401 - syncbn.groups.dist: the tests patch its all_reduce

# Beyond __all__, the seam also re-exports the helpers that syncbn's tools and tests use.
from . import _ddp, _meet, _own, _transport  # noqa: F401 - syncbn.join and the tests use them
from ._ddp import PlainJoinError, StepBound, UnboundedStepWarning, step_bound
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
    ShadowResult,
    SumGroup,
    Tag,
    decode_header,
    encode_header,
    header_fields,
)
from ._mesh import mesh_argument  # noqa: F401 - syncbn.convert
from ._refs import ProcessGroupRef, group_ranks
from ._resolve import _resolved, forget_destroyed, is_initialized, resolve, to_picklable  # noqa: F401
from ._subgroup import NODE, group_for, subgroup  # noqa: F401 - group_for: syncbn.convert
from ._sum import ProcessGroupSum, joined  # noqa: F401

_ddp.install()  # records DDP wrappers as they are built (see _ddp)

__all__ = [
    "SumGroup",
    "ProcessGroupSum",
    "ProcessGroupRef",
    "CollectiveError",
    "PlainJoinError",
    "UnboundedStepWarning",
    "StepBound",
    "step_bound",
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
