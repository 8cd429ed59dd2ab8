"""The CPU driver: the code path of ``nn.DataParallel`` on threads of one device, without GPUs."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .._threads import ReplicaSyncError, ordered_sum
from ._replication import abandon_replica, replicate_call

M = TypeVar("M", bound=nn.Module)


class _Broadcast(torch.autograd.Function):
    """``copies`` copies of each parameter; backward sums the copies' gradients in replica order."""

    @staticmethod
    def forward(ctx: Any, copies: int, *params: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.copies = copies
        ctx.count = len(params)
        return tuple(p.clone() for _ in range(copies) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        n = ctx.count
        return (None, *(ordered_sum([grads[j * n + i] for j in range(ctx.copies)]) for i in range(n)))


def replicate(network: M, copies: int, *, share_buffers: bool = True) -> list[M]:
    """Replicas of ``network`` on its own device, made the way ``nn.DataParallel`` makes them.

    Every module is copied with ``_replicate_for_data_parallel()``, so syncbn layers in the
    replicas synchronise with each other. Replica parameters are differentiable copies: the
    replicas' gradients are summed, in replica order, into the originals' ``.grad``. Buffers are
    copied, except that replica 0 may use the original buffers, as on ``nn.DataParallel``'s first device.

    Args:
        network: the model.
        copies: number of replicas, at least 1.
        share_buffers: let replica 0 use ``network``'s own buffers. Default: ``True``.

    Returns:
        ``copies`` replicas of ``network``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), syncbn.SyncBatchNorm1d(4))
        >>> replicas = syncbn.parallel.replicate(model, 2)
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"expected a number of copies of at least 1 (got {copies!r})")
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    params = list(network.parameters())
    param_index = {p: i for i, p in enumerate(params)}
    if params and torch.is_grad_enabled():
        flat = _Broadcast.apply(copies, *params)
        param_copies = [list(flat[j * len(params) : (j + 1) * len(params)]) for j in range(copies)]
    else:
        param_copies = [[p.detach() for p in params] for _ in range(copies)]

    module_copies: list[list[nn.Module]] = [[] for _ in range(copies)]
    for module in modules:
        for j in range(copies):
            with replicate_call(network, j, copies):
                module_copies[j].append(module._replicate_for_data_parallel())

    for i, module in enumerate(modules):
        for j in range(copies):
            replica = module_copies[j][i]
            for key, child in module._modules.items():
                if child is None:
                    replica._modules[key] = None
                else:
                    setattr(replica, key, module_copies[j][index[child]])
            for key, param in module._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    setattr(replica, key, param_copies[j][param_index[param]])
            for key, buf in module._buffers.items():  # replica 0 may share the originals
                replica._buffers[key] = (
                    buf if buf is None or (j == 0 and share_buffers) else buf.detach().clone()
                )
    return [module_copies[j][0] for j in range(copies)]  # type: ignore[misc]


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any]) -> list[Any]:
    """Run ``replicas[k](inputs[k])`` in thread ``k``, as ``nn.DataParallel`` does.

    Each thread inherits the caller's grad mode; a tuple input is unpacked into positional
    arguments. If replicas raise, every thread is still joined: a replica whose thread raised
    makes its siblings waiting at a synchronized layer raise :class:`ReplicaSyncError` at once.
    The root cause is re-raised: the first exception in replica order that is not a
    ``ReplicaSyncError`` (a note names the replicas that stopped waiting), else the first.

    Args:
        replicas: the replicas, e.g. from :func:`replicate`.
        inputs: one input (a tensor or a tuple of arguments) per replica.

    Returns:
        The outputs, in replica order.

    Example::

        >>> outs = syncbn.parallel.parallel_apply(replicas, [x[:3], x[3:]])
    """
    if len(replicas) != len(inputs):
        raise ValueError(
            f"expected one input per replica (got {len(inputs)} inputs for {len(replicas)} replicas)"
        )
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)
    grad_enabled = torch.is_grad_enabled()

    def work(k: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                args = inputs[k] if isinstance(inputs[k], tuple) else (inputs[k],)
                results[k] = replicas[k](*args)
        except BaseException as exc:  # re-raised in the caller
            errors[k] = exc
            abandon_replica(replicas[k], exc)  # its siblings waiting at a layer raise at once

    if len(replicas) == 1:
        work(0)
    else:
        threads = [
            threading.Thread(target=work, args=(k,), name=f"syncbn-replica-{k}", daemon=True)
            for k in range(len(replicas))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    _raise_root_cause(errors)
    return results


def _raise_root_cause(errors: list[BaseException | None]) -> None:
    """Raise the first error that is not a :class:`ReplicaSyncError` (the root cause), else the first."""
    raised = [(k, e) for k, e in enumerate(errors) if e is not None]
    if not raised:
        return
    causes = [(k, e) for k, e in raised if not isinstance(e, ReplicaSyncError)]
    k, error = causes[0] if causes else raised[0]
    waited = [j for j, e in raised if isinstance(e, ReplicaSyncError)]
    if causes and waited and hasattr(error, "add_note"):
        error.add_note(
            f"syncbn: raised in replica {k}; replica(s) {waited} then stopped waiting for it at a "
            f"synchronized layer (ReplicaSyncError: {errors[waited[0]]})"
        )
    raise error


def _gather(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs, 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_gather([out[i] for out in outputs]) for i in range(len(first)))
    raise TypeError(f"expected replica outputs that are tensors or tuples of tensors (got {type(first)})")


def data_parallel(module: nn.Module, input: Tensor, chunks: int | Sequence[int] = 2) -> Any:
    """Run ``module`` on ``input`` the way ``nn.DataParallel`` would, with threads on one device.

    The batch is split along dimension 0, each chunk runs through its own replica in its own
    thread (syncbn layers synchronise across the replicas), and the outputs are concatenated.
    Gradients flow back to ``module``'s parameters; running statistics land on ``module``.

    Args:
        module: the model.
        input: the batch, split along dimension 0.
        chunks: the number of replicas (split as evenly as possible, as ``torch.tensor_split``
            does) or the chunk sizes, which may be uneven and include zeros. Default: 2.

    Shape:
        - Input: :math:`(N, *)`
        - Output: the module's output for the whole batch, :math:`(N, *)`.

    Returns:
        The concatenated outputs.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8))
        >>> y = syncbn.parallel.data_parallel(model, torch.randn(6, 3, 9, 9), chunks=[4, 2])
        >>> y.shape
        torch.Size([6, 8, 7, 7])
    """
    if not isinstance(input, Tensor) or input.dim() == 0:
        raise TypeError(f"expected a tensor input with a batch dimension (got {type(input).__name__})")
    if isinstance(chunks, bool):
        raise TypeError(f"expected an int or a sequence of chunk sizes (got {chunks!r})")
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"expected at least 1 chunk (got chunks={chunks})")
        parts = list(torch.tensor_split(input, chunks))
    else:
        sizes = [int(s) for s in chunks]
        if not sizes or min(sizes) < 0 or sum(sizes) != input.shape[0]:
            raise ValueError(
                f"expected non-negative chunk sizes summing to the batch size {input.shape[0]} (got {sizes})"
            )
        parts = list(torch.split(input, sizes))
    replicas = replicate(module, len(parts))
    return _gather(parallel_apply(replicas, parts))
