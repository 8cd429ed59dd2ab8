"""One exact running-statistics update per optimizer step under accumulation (docs/internals/tools.md)."""

from __future__ import annotations

import sys
import zlib
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _accumulating, _cmbn, groups
from ._abn_layer import ActivatedBatchNormBase
from ._layer import LayerMixin, training_call
from .engine import _rules
from .families import BATCH_NORM
from .modules import SyncBatchNorm

__all__ = ["accumulation"]

_NORMALIZE = ("micro-batch", "cumulative")


def check_normalize(normalize: object) -> None:
    """``ValueError`` unless ``normalize`` is ``"micro-batch"`` or ``"cumulative"``."""
    if normalize not in _NORMALIZE:
        raise ValueError(f"syncbn.accumulation: expected normalize one of {_NORMALIZE} (got {normalize!r})")


def _check_poolable(layer: nn.Module) -> None:
    """``TypeError`` for a layer that ``normalize="cumulative"`` cannot pool (it never runs the engine)."""
    if isinstance(layer, SyncBatchNorm) or (isinstance(layer, ActivatedBatchNormBase) and layer._in_place):
        return
    raise TypeError(
        "syncbn.accumulation(normalize='cumulative'): expected syncbn's SyncBatchNorm, SyncBatchRenorm "
        f"or in-place layers (got {type(layer).__module__}.{type(layer).__qualname__}, whose forward "
        "normalises each micro-batch alone); convert the model with syncbn.convert_sync_batchnorm first"
    )


def _group(layer: nn.Module) -> Any:
    """The group the layer's training calls synchronise over (``None``: local, seen by the hooks)."""
    if isinstance(layer, nn.SyncBatchNorm):
        raise TypeError(
            "syncbn.accumulation: expected syncbn's layers or plain BatchNorm "
            f"(got torch.nn.SyncBatchNorm, {type(layer).__name__}); convert the model with "
            "syncbn.convert_sync_batchnorm first"
        )
    if not isinstance(layer, LayerMixin) or (isinstance(layer, ActivatedBatchNormBase) and layer._local):
        return None  # plain nn.BatchNorm*, the package's InPlaceABN: always local
    return groups.resolve(layer._group())


class _Layer:
    """One layer's state in a block: the snapshot to restore and the moments merged so far."""

    def __init__(self, layer: nn.Module, cumulative: bool = False) -> None:
        # Local layers are seen by hooks; _group may refuse the layer: before anything is registered.
        hooked = not cumulative and _group(layer) is None
        self.layer = layer
        running_mean, running_var = layer.running_mean, layer.running_var
        assert isinstance(running_mean, Tensor) and isinstance(running_var, Tensor)
        self.running_mean, self.running_var = running_mean, running_var
        # Each buffer and its value at begin: the running statistics, then num_batches_tracked if any.
        buffers = (running_mean, running_var, layer.num_batches_tracked)
        self.saved = [(t, t.detach().clone()) for t in buffers if isinstance(t, Tensor)]
        self.moments = _accumulating.listen(running_mean)
        self.pending: tuple[int, Tensor, Tensor] | None = None
        self.hooks: list[Any] = []
        # normalize="cumulative": every call runs the engine, whose statistics hook pools it here
        self.carry = _cmbn.attach(layer, running_mean.shape[0], running_mean.device) if cumulative else None
        if hooked:
            self.hooks.append(layer.register_forward_pre_hook(self._before, with_kwargs=True))
            self.hooks.append(layer.register_forward_hook(self._after))

    def _before(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.pending = None
        if not layer.training or getattr(layer, "freeze", False) or not layer.track_running_stats:
            return
        if not _rules.is_compiling() and _rules.in_backward():  # torch.utils.checkpoint recomputing
            return
        if layer.__dict__.get("_syncbn_replica") is not None or not args or not isinstance(args[0], Tensor):
            return
        if isinstance(layer, SyncBatchNorm) and layer._family_call() is not BATCH_NORM:
            return  # a family (renorm) runs the engine even without a group: it reports the moments
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        values = args[0].detach().movedim(1, -1)  # (M, C): the valid positions
        values = values[mask] if mask is not None else values.reshape(-1, values.shape[-1])
        if values.numel():
            var, mean = torch.var_mean(values.to(torch.float64), dim=0, correction=0)
            self.pending = (values.shape[0], mean, var)

    def _after(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.pending is not None:
            self.moments.add(*self.pending)
            self.pending = None

    def stop(self) -> None:
        """Stop listening."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        _accumulating.stop(self.moments)
        _cmbn.detach(self.layer)

    def seen(self) -> _Seen:
        """What this rank saw: whether the layer ran, and the merged moments (read on the host)."""
        ran = len(self.saved) == 3 and not torch.equal(*self.saved[2])
        return _Seen(ran, *(self.moments if self.carry is None else self.carry).result())

    def close(self, seen: _Seen | None) -> None:
        """Put the statistics back, then apply the one update of ``seen`` (``None``: none)."""
        with torch.no_grad():
            for tensor, value in self.saved:
                tensor.copy_(value)
            if seen is None:
                return
            call = training_call(self.layer, False)  # the block's one training call over all its batches
            if seen.ran:
                call.counted(None)
            if seen.total <= 0.0:
                return
            unbiased = seen.m2 / max(seen.total - 1.0, 1.0)
            for running, batch in ((self.running_mean, seen.mean), (self.running_var, unbiased)):
                running.lerp_(batch.to(running.dtype), call.momentum)


class _Seen(NamedTuple):
    """What one rank's block saw of a layer: whether it ran, and its merged moments (float64)."""

    ran: bool
    total: float
    mean: Tensor
    m2: Tensor


_VOTE = groups.Tag(zlib.crc32(b"syncbn.accumulation") & 0x7FFFFFFF, groups.PHASE_OTHER)
_SHARE = groups.Tag(zlib.crc32(b"syncbn.accumulation moments") & 0x7FFFFFFF, groups.PHASE_OTHER)


def _vote(group: groups.ProcessGroupSum, vote: Tensor) -> Tensor:
    """The framed sum of the votes; tried once more after a mismatch: a peer was then still at a
    layer's collective, which raised there too, so it is on its way to its own vote."""
    try:
        return group.all_reduce_sum_bounded(vote.clone(), host_wait=True, tag=_VOTE)
    except groups.CollectiveError as exc:
        if not exc.mismatch:
            raise
    return group.all_reduce_sum_bounded(vote, host_wait=True, tag=_VOTE)


def _agree(group: groups.ProcessGroupSum, seen: list[_Seen], commit: bool) -> list[_Seen] | None:
    """One vote of the group's ranks at the block's end: the layers' update, or ``None`` (discard). Any
    discard: every rank discards; unequal counts: the moments of the first rank that saw the most."""
    device = seen[0].mean.device
    vote = torch.zeros(1 + group.size, dtype=torch.float64, device=device)
    vote[0] = 0.0 if commit else 1.0
    vote[1 + group.rank] = sum(s.total for s in seen)
    summed = _vote(group, vote).tolist()
    counts = summed[1:]
    if summed[0] > 0.0 or not commit:
        return None
    if min(counts) == max(counts):
        return seen
    source = counts.index(max(counts))
    parts: list[Tensor] = []
    for s in seen:
        head = torch.tensor([float(s.ran), s.total], dtype=torch.float64)
        parts += [t.reshape(-1).to(device, torch.float64) for t in (head, s.mean, s.m2)]
    flat = torch.cat(parts)
    if group.rank != source:
        flat.zero_()
    group.all_reduce_sum_bounded(flat, host_wait=True, tag=_SHARE)
    taken: list[_Seen] = []
    for s, chunk in zip(seen, flat.split([2 + 2 * s.mean.numel() for s in seen])):
        head, mean, m2 = chunk.split([2, s.mean.numel(), s.mean.numel()])
        ran, count = head.tolist()
        taken.append(_Seen(ran > 0.0, count, mean.view_as(s.mean), m2.view_as(s.m2)))
    return taken


def _decide(
    opened: list[_Layer], seen: list[_Seen], commit: bool, error: BaseException | None
) -> list[_Seen | None]:
    """Each layer's update (``None``: put back) as the ranks of its group agree (:func:`_agree`). One vote per
    group; local layers and replicas' follow this rank; a discard anywhere puts back all."""
    # No vote when the process is going down, or after a failed collective (a timeout, a dead peer),
    # which left the group unusable on every rank.
    if error is not None and (
        not isinstance(error, Exception) or (isinstance(error, groups.CollectiveError) and not error.mismatch)
    ):
        return [None] * len(opened)
    members: dict[int, tuple[groups.ProcessGroupSum, list[int]]] = {}
    for i, state in enumerate(opened):
        group = _group(state.layer)
        if state.moments.local:  # nn.DataParallel replicas' moments: this process's alone
            continue
        if isinstance(group, groups.ProcessGroupSum):  # (under a Join: its wrapper, no vote)
            members.setdefault(id(group), (group, []))[1].append(i)
    decided: list[_Seen | None] = list(seen) if commit else [None] * len(opened)
    failed: groups.CollectiveError | None = None
    for group, index in members.values():
        try:
            agreed = _agree(group, [seen[i] for i in index], commit)
        except groups.CollectiveError as exc:
            agreed = None
            if commit:  # the other groups still get this rank's vote (discard): nobody waits for it
                failed = exc._rephrased(
                    "syncbn.accumulation: the ranks' vote at the end of the block failed, so this "
                    "rank put its running statistics back as they were at begin() (every rank of "
                    f"the group must close the block alike): {exc.args[0]}",
                )
            # a discarding rank puts its statistics back whatever the others do
        for i, update in zip(index, agreed or []):
            decided[i] = update
        commit = commit and agreed is not None  # a discard agreed anywhere: later votes, every layer
    if failed is not None:
        raise failed
    if not commit:  # every layer of this rank, the groups voted before the discard included
        return [None] * len(opened)
    return decided


class accumulation:  # noqa: N801 - used like torch.no_grad
    """One exact running-statistics update for all micro-batches of a gradient-accumulation step.

    Use it around the ``k`` forward/backward passes of one optimizer step (how each micro-batch is normalised:
    ``normalize``). When the block ends, each layer's ``running_mean`` and ``running_var`` take **one**
    momentum update with the mean and unbiased variance of all micro-batches of all ranks together, and
    ``num_batches_tracked`` goes up by one: exactly what one training forward over the concatenated ``k x W``
    micro-batches would leave (``momentum=None`` included).

    No collective is added per call: the block merges the global moments the layers already sum (in float64,
    Chan's formulas). Closing it is one small collective over the layers' group (a vote of ``1 + W`` values,
    bounded by :func:`syncbn.set_timeout`): if any rank leaves the block with an exception or calls
    :meth:`discard`, every rank puts the running statistics and ``num_batches_tracked`` back as they were; a
    rank that saw fewer values than another (it joined early under ``Join``) takes the moments of one that saw
    them all. So the ranks' statistics stay identical, and every rank of the group must close its block.
    Inside an active ``Join`` there is no vote (a joined rank cannot answer): open the block around the
    ``Join``. Covers syncbn's layers and plain ``nn.BatchNorm*`` (local, seen by a forward pre-hook);
    ``torch.nn.SyncBatchNorm`` is refused (convert the model first).

    Raises:
        CollectiveError: at :meth:`commit` (or the end of the ``with``), the vote failed (a rank did not close
            its block within the bound); the statistics were put back on this rank.

    Args:
        model: the module whose batch-norm layers accumulate (DDP wrappers and
            the like too: every submodule is searched).
        normalize: ``"micro-batch"`` (default): each micro-batch is normalised with its own statistics
            (synchronised as always). ``"cumulative"`` (CmBN, docs/cmbn.md): micro-batch ``t`` with the count,
            mean and biased variance of micro-batches ``1..t`` of all ranks together, the earlier ones
            constants in backward (the gradient is batch norm's with the pooled count); the first micro-batch
            is plain synchronised batch norm. Same collectives, one running update at the end. Needs syncbn's
            layers (``SyncBatchNorm``, ``SyncBatchRenorm``, the in-place layers; others raise ``TypeError``);
            those without running statistics normalise each micro-batch alone.

    Example::

        >>> import torch, syncbn
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8))
        >>> with syncbn.accumulation(model):
        ...     for micro in torch.randn(4, 2, 3, 8, 8):   # 4 micro-batches of 2
        ...         model(micro).square().mean().backward()
        >>> int(model[1].num_batches_tracked)              # one update per optimizer step
        1

    A training loop's hooks can also drive it by hand: :meth:`begin`, then :meth:`commit` or :meth:`discard`.
    """

    def __init__(self, model: nn.Module, normalize: str = "micro-batch") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"syncbn.accumulation: expected an nn.Module (got {type(model).__name__})")
        check_normalize(normalize)
        self.model = model
        self.cumulative = normalize == "cumulative"
        self._open: list[_Layer] | None = None
        self._failed = False  # the last close raised (the statistics were put back)

    @property
    def active(self) -> bool:
        """Whether the block is collecting (between :meth:`begin` and :meth:`commit`/:meth:`discard`)."""
        return self._open is not None

    def begin(self) -> accumulation:
        """Snapshot the running statistics and start collecting the micro-batches' moments."""
        if self._open is not None:
            raise RuntimeError(
                "syncbn.accumulation: begin() called twice (expected commit() or discard() between)"
            )
        opened: list[_Layer] = []
        layers = [m for m in self.model.modules() if isinstance(m, (_BatchNorm, ActivatedBatchNormBase))]
        for layer in layers if self.cumulative else ():  # refused before anything changes
            _check_poolable(layer)
        try:
            for layer in layers:
                if layer.track_running_stats and isinstance(layer.running_mean, Tensor):
                    opened.append(_Layer(layer, self.cumulative))
        except BaseException:
            for state in opened:
                state.stop()
                state.close(None)
            raise
        self._open = opened
        return self

    def commit(self) -> None:
        """Apply the one update with every micro-batch seen since :meth:`begin` (the ranks vote), and stop."""
        self._close(commit=True, error=None)

    def discard(self) -> None:
        """Put the running statistics back as they were at :meth:`begin`, and stop.

        Called while handling an exception (``except``, Lightning's ``on_exception``), it reads
        that exception: after a failed collective it does not vote. After a :meth:`commit` that
        raised (the statistics were put back then), it does nothing.
        """
        self._close(commit=False, error=sys.exc_info()[1])

    def _close(self, commit: bool, error: BaseException | None) -> None:
        opened, self._open = self._open, None
        failed, self._failed = self._failed, False
        if opened is None:
            if failed and not commit:  # discard() after a commit() that raised: already put back
                return
            raise RuntimeError("syncbn.accumulation: not collecting (expected begin() first)")
        for state in opened:
            state.stop()
        decided: list[_Seen | None] = [None] * len(opened)
        try:
            decided = _decide(opened, [state.seen() for state in opened], commit, error)
        except BaseException:
            self._failed = True
            raise
        finally:  # on an error too: every layer put back (and nothing applied)
            for state, update in zip(opened, decided):
                state.close(update)

    def __enter__(self) -> accumulation:
        return self.begin()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._close(commit=kind is None, error=value)
