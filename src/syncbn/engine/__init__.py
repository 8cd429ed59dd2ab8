"""The engine: what every layer family's synchronised training step shares, written once.

One training step of any family (:mod:`syncbn.families`) runs, in this package,
on ``x``, ``weight`` and ``bias`` (the tensors autograd tracks, direct arguments
of every ``Function.apply``) and ONE :class:`_function.Params`: the running
statistics, eps, momentum, group, layer and family object, built once at the
entry (the layer, :func:`syncbn.functional.sync_batch_norm`, a DataParallel
replica) and carried through every step below, eager and traced alike:

1. the handshake and Join policy (:func:`_function.checks_before_forward`):
   first-use agreement of the ranks, debug checks, or the active Join's exchange;
2. the moments (:func:`_function.synchronized_moments`): local count, mean and
   M2 (:mod:`._math`), packed in float64 (:mod:`._packing`), ONE framed sum
   through a reducer (a process group, DataParallel's replica threads, the
   compile operator of :mod:`._ops`, or none), then the count rules (empty
   batch, one value per channel) before anything changes;
3. the family's elementwise forward (batch norm's one native pass, renorm's
   effective affine map, or the in-place activation written over the input) and
   the update of the call's running statistics (:meth:`_function.Moments.update_running`);
4. backward: the family's local sums, ONE framed sum, the family's input and
   parameter gradients from the forward's :class:`._math.Stats`.

The autograd plumbing exists once for every family: eager and ``torch.func``
(:mod:`._function`), traced for ``torch.compile`` (:mod:`._compiled` around
the operator of :mod:`._ops`), differentiable backward (:mod:`._double_backward`)
and DataParallel's joint node (:mod:`syncbn.parallel`); dtype rules and the
one-value error in :mod:`._rules`.

The package imports nothing itself: ``import syncbn.engine`` costs nothing, and
:mod:`._ops` (which needs a torch with ordered effectful operators) is loaded
only by the layers that compile.
"""
