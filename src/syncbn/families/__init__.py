"""Layer families: only their math, on the one engine.

A family object is made per call and handed to the engine in the call's
:class:`syncbn.engine._function.Params`; the engine owns everything else. ``None`` is batch norm;
:class:`Renorm` and the in-place :class:`~syncbn.families.inplace_abn.InPlaceABN` are the others.
Their hooks and layering: docs/architecture.md.
"""

from .renorm import Renorm

__all__ = ["Renorm"]
