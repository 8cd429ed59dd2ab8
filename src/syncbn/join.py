"""Uneven inputs: SyncBatchNorm layers under torch's ``Join``. The protocol: docs/internals/tools.md."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from . import _config, groups
from ._layer import LayerMixin
from ._row import _DTYPES, _dtype_code
from .groups import _sum

__all__ = ["JoinableSyncBatchNorm"]


_HEADER = 4


class JoinableSyncBatchNorm(Joinable):
    """Makes the SyncBatchNorm layers of ``model`` joinable, for uneven inputs.

    Pass it to ``torch.distributed.algorithms.Join`` first, before the DDP model: a rank that has run out of
    batches then contributes an empty batch to every SyncBatchNorm collective of the ranks still training, and
    nothing hangs. Create it on every rank at the same point (it creates a process group with syncbn's bound
    as its timeout); the layers must synchronise over the default group. Without it, ``Join([ddp])`` alone
    raises :class:`syncbn.groups.PlainJoinError` on every rank at its first SyncBatchNorm collective.

    Args:
        model: the model, bare or wrapped in ``DistributedDataParallel``.

    Raises:
        ValueError: ``torch.distributed`` is not initialised, or a layer of any family holds a
            process group of its own (``process_group``, or the ``group`` of
            ``compat.inplace_abn``); at ``Join(...)``, when the joinable is not first in the list.

    Example::

        >>> from torch.distributed.algorithms import Join
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
        >>> joinable = syncbn.JoinableSyncBatchNorm(ddp)
        >>> with Join([joinable, ddp]):
        ...     for x, y in loader:          # a different number of batches per rank
        ...         loss_fn(ddp(x), y).backward()
        ...         optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, model: nn.Module) -> None:
        if not groups.is_initialized():
            raise ValueError("JoinableSyncBatchNorm needs an initialised torch.distributed process group")
        others = [m for m in model.modules() if isinstance(m, LayerMixin) and m._group() is not None]
        if others:
            raise ValueError(
                "JoinableSyncBatchNorm supports layers synchronising over the default group only; "
                f"{len(others)} layer(s) have process_group set (e.g. {type(others[0]).__name__})"
            )
        super().__init__()  # sets _join_config: a disabled configuration
        self._model = model
        # Every rank meets within the bound first (a rank that never builds its joinable is named);
        # syncbn's bound is the group's timeout, so gloo gives up at the bound too.
        ranks = list(range(dist.get_world_size()))
        group = groups._meet.new_group("syncbn.JoinableSyncBatchNorm(model)", ranks, _config.timeout_delta())
        key = groups._own.adopt(group)  # held there only: destroyed in order when this joinable goes
        self._sum = groups.ProcessGroupSum(group, own_group=True)
        weakref.finalize(self, groups._own.release, key, groups._own.bound_s(group) + 1.0)
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        model.register_forward_pre_hook(self._notify)
        self.shadowed = 0  # collectives this rank shadowed as a joined rank (for tests and logs)
        self._hook: Callable[[], _ShadowHook | None] = lambda: None  # no Join holds the joinable yet
        self._wrap = self._wrapper  # the one callable installed with groups._sum.set_join
        self._wrapped: _JoinedGroup | None = None

    # Set by Join when it is built: join mode starts.
    @property
    def _join_config(self) -> _JoinConfig:
        return self._config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        if config.enable and not config.is_first_joinable:
            raise ValueError(
                "syncbn: put the JoinableSyncBatchNorm first in the Join list, e.g. "
                "Join([joinable, ddp_model]): a joined rank must start shadowing the SyncBatchNorm "
                "collectives before another joinable's hook waits for the training ranks"
            )
        self._config = config
        if config.enable:
            self._thread, self._thread_error, self.shadowed = None, None, 0
            _sum.set_join(self._wrap)

    def _wrapper(self, group: groups.ProcessGroupSum) -> Any:
        """The default ``group`` as training calls use it in join mode."""
        if not self.live():
            if _sum._join is self._wrap:
                _sum.set_join(None)
            return group
        if self._wrapped is None or self._wrapped.base is not group:
            self._wrapped = _JoinedGroup(self.all_reduce, group)
        return self._wrapped

    def _notify(self, module: nn.Module, args: Any) -> None:
        # The per-iteration all_reduce the joined ranks count with; DDP, second in the list, gets
        # this work handle, as it uses its own when first (its gradient division may use the count).
        if _sum._join is not self._wrap:
            return
        groups._ddp.cover(self._model)  # this Join shadows syncbn: not a plain Join([ddp])
        work = Join.notify_join_context(self)
        if work is not None and isinstance(module, nn.parallel.DistributedDataParallel):
            module.reducer._set_forward_pass_work_handle(work, module._divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a joined rank: it shadows SyncBatchNorm collectives."""
        hook = _ShadowHook(self)
        self._hook = weakref.ref(hook)  # held by the Join: gone with it
        return hook

    def live(self) -> bool:
        """Whether the ``Join`` holding this joinable is still going (one whose body raised runs no
        post-hooks: join mode then ends when the ``Join`` object is gone)."""
        return self._hook() is not None

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.distributed_c10d._get_default_group()

    # Active side: every SyncBatchNorm collective, through the _JoinedGroup groups.resolve hands out.
    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Header then payload, on the joinable's own group (docs/internals/tools.md)."""
        n = float(tensor.numel())
        code = _dtype_code(tensor.dtype)
        header = torch.tensor([1.0, n, n * n, code], dtype=torch.float64)
        self._sum.all_reduce_sum(header)
        active, total, squares, codes = header.tolist()
        if total * total != active * squares or codes != active * code:
            raise ValueError(
                f"syncbn: under Join, the {int(active)} training ranks made different SyncBatchNorm "
                f"collectives at the same point (this rank: {int(n)} values of {tensor.dtype}; mean over "
                f"the ranks: {total / active:g} values); every rank must call the layers in the same order"
            )
        return self._sum.all_reduce_sum(tensor)

    # Joined side.
    def _shadow(self) -> None:
        try:
            while True:
                header = torch.zeros(_HEADER, dtype=torch.float64)
                self._sum.all_reduce_sum(header)
                active, total, _, codes = header.tolist()
                if active == 0:
                    return
                size, code = int(total / active), int(codes / active)
                dtype = _DTYPES[code - 1] if 1 <= code <= len(_DTYPES) else torch.float64
                self._sum.all_reduce_sum(torch.zeros(size, dtype=dtype))
                self.shadowed += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised by the post-hook
            self._thread_error = exc

    def _finish(self) -> None:
        try:
            if self._thread is None:
                self._sum.all_reduce_sum(torch.zeros(_HEADER, dtype=torch.float64))
            else:
                self._thread.join(timeout=_config.get_timeout())
                if self._thread.is_alive():
                    raise RuntimeError(
                        "syncbn: the Join shadow thread did not finish within "
                        f"{_config.get_timeout():g} s after every rank joined"
                    )
                if self._thread_error is not None:
                    raise self._thread_error
        finally:
            groups._ddp.cover(self._model)  # every rank: the Join's configuration stays on DDP
            if _sum._join is self._wrap:
                _sum.set_join(None)
            self._thread, self._wrapped = None, None


class _JoinedGroup:
    """The default group under an active Join: every sum through the joinable (not framed: no checks)."""

    def __init__(self, all_reduce_sum: Callable[[Tensor], Tensor], base: groups.ProcessGroupSum) -> None:
        self.all_reduce_sum, self.base = all_reduce_sum, base
        self.size, self.rank = base.size, base.rank


class _ShadowHook(JoinHook):
    def __init__(self, joinable: JoinableSyncBatchNorm) -> None:
        self._joinable = joinable

    def main_hook(self) -> None:
        joinable = self._joinable
        if joinable._thread is None:
            joinable._thread = threading.Thread(
                target=joinable._shadow, name="syncbn-join-shadow", daemon=True
            )
            joinable._thread.start()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._joinable._finish()
