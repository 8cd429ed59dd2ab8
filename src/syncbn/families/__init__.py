"""Layer families: only their math, on the one engine, through the protocol of :mod:`._protocol`.

A family object is made per call and handed to the engine in the call's
:class:`syncbn.engine._function.Params`; the engine owns everything else. Batch norm is
:data:`BATCH_NORM`; :class:`Renorm` and the in-place :class:`~syncbn.families.inplace_abn.InPlaceABN`
are the others. Their phases and layering: docs/architecture.md.
"""

from .batchnorm import BATCH_NORM, BatchNorm
from .renorm import Renorm

__all__ = ["BATCH_NORM", "BatchNorm", "Renorm"]
