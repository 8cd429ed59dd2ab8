"""Layer families: only their math, on the one engine.

A family object is made per call and handed, in the call's
:class:`syncbn.engine._function.Params`, to the engine, which owns everything else (moments,
packing, count rules, the collective, checks, running update, autograd). ``None`` is batch
norm; :class:`Renorm` (:mod:`~syncbn.families.renorm`) and the in-place
:class:`~syncbn.families.inplace_abn.InPlaceABN`, imported from its module, are the others.
docs/architecture.md lists each family's hooks. Families import torch (the in-place family
also :mod:`syncbn.engine._math`'s helpers); the engine calls them, never the other way.
"""

from .renorm import Renorm

__all__ = ["Renorm"]
