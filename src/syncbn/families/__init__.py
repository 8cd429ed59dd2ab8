"""Layer families: only their math, on the one engine.

A family says what differs between synchronised normalisation layers, in
torch's own phase names; the engine (:mod:`syncbn.engine._function` eager,
:mod:`syncbn.engine._compiled` traced, :mod:`syncbn.parallel` replicas) owns
everything else: local moments, packing, the count/empty/one-value rules, the
framed collective, the handshake and Join policy, the running-statistics
update, dtype rules and the autograd plumbing.

* ``batchnorm`` (the engine's default, no object): normalise with the batch's
  global statistics; parameter gradients ``sum(dy * xhat)`` and ``sum(dy)``.
* :mod:`~syncbn.families.renorm` (:class:`Renorm`): Batch Renormalization, the
  batchnorm math with the effective affine map ``(w r, b + w d)`` where ``r``
  and ``d`` are constants of the step.
* :mod:`~syncbn.families.inplace_abn` (:class:`InPlaceABN`, imported from its
  module: it builds on :mod:`syncbn.engine._math`): affine + activation written over
  the input, the backward recovering ``xhat`` from the output.

A family object is made per call and handed, in the call's
:class:`syncbn.engine._function.Params`, to the engine's one set of autograd
Functions (eager, ``torch.func``, traced, DataParallel). Renorm's has
(per-channel vectors, no communication, traceable by ``torch.compile``):

``correction(mean, var, eps)``
    ``(r, d)`` from the step's global statistics, or ``None`` (none: batchnorm).
``affine(weight, bias, r, d)``
    the effective ``(weight, bias)`` of the elementwise forward and input gradient.
``parameter_grads(sum_dy, sum_dy_xhat, r, d)``
    the weight and bias gradients from the backward's local reductions.
``snapshot(copy)``
    the object with ``copy`` of any state the step updates in place (the traced
    engine needs them: AOTAutograd may otherwise let the backward read a running
    statistic after the forward's in-place update).

The in-place family (``in_place`` true) supplies its phases instead: the
elementwise forward written over the input, the backward's local reduction from
the output, the input gradient, the parameter gradients, and their traced twins
(see :class:`syncbn.families.inplace_abn.InPlaceABN`).

Families import torch (the in-place family also :mod:`syncbn.engine._math`'s helpers); the engine
calls them, never the other way.
"""

from .renorm import Renorm

__all__ = ["Renorm"]
