"""``nn.DataParallel`` integration, and a small CPU driver that does what it does.

How syncbn layers synchronise inside a plain ``nn.DataParallel``
----------------------------------------------------------------
Every forward, ``nn.DataParallel`` replicates the model (``replicate`` calls
``module._replicate_for_data_parallel()`` once per replica for every module),
runs replica ``k`` on chunk ``k`` of the batch in thread ``k``, and gathers.

1. **Replication.** :class:`~syncbn.SyncBatchNorm` overrides
   ``_replicate_for_data_parallel`` to call :func:`attach_replica`, which gives
   the replicas of one layer made by one ``replicate`` call a shared
   *replication*: a :class:`~syncbn._threads.Rendezvous` of as many members as
   there are replicas, each replica knowing its index. No wrapper class and no
   callback are needed.
2. **Forward.** Replica ``k`` computes its chunk's moments (the same math as the
   multi-process path, :mod:`syncbn._math`), and a
   :class:`~syncbn._threads.ThreadSumGroup` sums the packed moments over the
   replicas in replica order, so every replica gets the same bits whatever the
   threads' timing. Each replica normalises its own chunk in its own thread.
   Replica 0 then writes the updated running statistics (identical on every
   replica) into the layer the user holds: they are not lost with the replicas.
3. **One autograd node for all replicas.** The replicas' outputs are joined into
   a single autograd node (a second, cheap rendezvous). Its backward receives
   every replica's output gradient at once, sums the per-replica
   ``[sum(dy), sum(dy*xhat)]`` in replica order and returns each replica's input
   gradient and its *local share* of the weight/bias gradients (``nn.DataParallel``
   sums those into the original parameters). Backward therefore never waits for
   another thread: on CPU the autograd engine runs every replica's backward in
   the one thread that called ``backward()``, one node after another, so a
   backward that blocked until the other replicas arrived would deadlock there;
   on CUDA the node runs on one device's autograd thread.
4. **Bounded waits.** A replica that never reaches a layer (a data-dependent
   branch, an exception in its thread) leaves the others waiting; after
   :func:`get_replica_timeout` seconds they raise
   :class:`~syncbn._threads.ReplicaSyncError` naming the layer, never hang.

A single replica is exactly ``nn.BatchNorm``. Eval mode and ``freeze=True``
never synchronise. Inside replicas the layer's ``process_group`` is not used:
the statistics span the replicas of this process.

The CPU driver
--------------
:func:`data_parallel` splits a batch into chunks (uneven and empty chunks
allowed), :func:`replicate` copies the model the way ``nn.DataParallel`` does
(replicas share the parameters differentiably; replica 0 shares the buffers),
:func:`parallel_apply` runs each replica in its own thread, and the outputs are
concatenated. It needs no GPU: tests and examples use it to run the very code
path ``nn.DataParallel`` takes.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _math
from ._function import finish_input_grad, local_grad_sums, synchronized_forward
from ._threads import Rendezvous, ReplicaSyncError, ThreadSumGroup, ordered_sum

__all__ = [
    "ReplicaSyncError",
    "attach_replica",
    "data_parallel",
    "get_replica_timeout",
    "parallel_apply",
    "replicate",
    "set_replica_timeout",
]

M = TypeVar("M", bound=nn.Module)

_timeout = 120.0


def get_replica_timeout() -> float:
    """Seconds a replica waits for the other replicas at a synchronized layer."""
    return _timeout


def set_replica_timeout(seconds: float) -> float:
    """Set how long a replica waits for the others at a synchronized layer.

    Applies to replications made from now on (each ``nn.DataParallel`` forward
    makes a new one). When the wait runs out, the waiting replicas raise
    :class:`~syncbn._threads.ReplicaSyncError` naming the layer.

    Args:
        seconds: a positive number of seconds. Default: 120.

    Returns:
        The previous value.

    Example::

        >>> old = syncbn.parallel.set_replica_timeout(10.0)
    """
    global _timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"expected a positive number of seconds (got {seconds!r})")
    old, _timeout = _timeout, float(seconds)
    return old


# ---------------------------------------------------------------------------------------------
# Replication: which replicas of a layer belong together
# ---------------------------------------------------------------------------------------------


class _Replication:
    """The replicas of one layer made by one ``replicate`` call."""

    def __init__(self, master: nn.Module, expected: int | None, root: nn.Module | None) -> None:
        self.master = master
        self.expected = expected  # number of replicas, when replicate() told us
        self.count = 0
        self._root = None if root is None else weakref.ref(root)
        self._rendezvous: Rendezvous | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._rendezvous is not None

    def add(self) -> int:
        self.count += 1
        return self.count - 1

    def rendezvous(self) -> Rendezvous:
        """The replicas' rendezvous; the first call fixes its size."""
        with self._lock:
            if self._rendezvous is None:
                size = self.expected if self.expected is not None else self.count
                self._rendezvous = Rendezvous(size, _timeout, label=self.describe)
            return self._rendezvous

    def describe(self) -> str:
        """The layer's name in the replicated model, when known, and its shape."""
        master = self.master
        text = f"{type(master).__name__}({getattr(master, 'num_features', '?')})"
        root = None if self._root is None else self._root()
        if root is not None:
            for name, module in root.named_modules():
                if module is master:
                    return f"layer '{name or type(root).__name__}' ({text})"
        return f"layer {text}"

    def publish(self, replica: nn.Module) -> None:
        """Copy the replica's running statistics into the layer the user holds."""
        with torch.no_grad():
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                mine = replica._buffers.get(key)
                theirs = self.master._buffers.get(key)
                if mine is None or theirs is None or mine is theirs:
                    continue
                if mine.device == theirs.device and mine.data_ptr() == theirs.data_ptr():
                    continue
                theirs.copy_(mine)


class _ReplicaSlot:
    """What a replica holds: its replication and its index in it."""

    __slots__ = ("replication", "index")

    def __init__(self, replication: _Replication, index: int) -> None:
        self.replication = replication
        self.index = index

    def forward(self, layer: _BatchNorm, input: Tensor, momentum: float) -> Tensor:
        return _replica_batch_norm(layer, input, momentum, self.replication, self.index)


_open: weakref.WeakKeyDictionary[nn.Module, _Replication] = weakref.WeakKeyDictionary()
_open_lock = threading.Lock()
_local = threading.local()


def _replicate_call() -> tuple[nn.Module | None, int, int] | None:
    """``(network, j, num_replicas)`` of the ``replicate`` call making this replica.

    Our :func:`replicate` says so explicitly; ``torch.nn.parallel.replicate``
    is recognised by its frame (locals ``network``, ``j``, ``num_replicas``).
    ``None`` when neither is found: replicas then join the latest replication
    that has not started its forward yet.
    """
    explicit = getattr(_local, "call", None)
    if explicit is not None:
        return explicit  # type: ignore[no-any-return]
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code.co_name == "replicate":
            names = frame.f_locals
            j, n, network = names.get("j"), names.get("num_replicas"), names.get("network")
            if isinstance(j, int) and isinstance(n, int) and 0 <= j < n:
                return (network if isinstance(network, nn.Module) else None, j, n)
            return None
    return None


def attach_replica(master: nn.Module, replica: nn.Module) -> None:
    """Enrol ``replica`` (a fresh replica of ``master``) in its replication.

    Called by :meth:`syncbn.SyncBatchNorm._replicate_for_data_parallel`; users
    do not call it. The replicas of ``master`` made by one ``replicate`` call
    share one rendezvous, replica ``j`` being member ``j``.

    Args:
        master: the layer being replicated (the one the user holds).
        replica: the new replica.
    """
    call = _replicate_call()
    with _open_lock:
        current = _open.get(master)
        if call is not None:
            root, j, n = call
            if current is None or j == 0 or current.started or current.expected != n or current.count != j:
                current = _open[master] = _Replication(master, n, root)
        elif current is None or current.started:
            current = _open[master] = _Replication(master, None, None)
        index = current.add()
    replica.__dict__["_syncbn_replica"] = _ReplicaSlot(current, index)


# ---------------------------------------------------------------------------------------------
# The synchronized forward of one replica, and the joint backward of all of them
# ---------------------------------------------------------------------------------------------


class _Record(NamedTuple):
    """One replica's contribution to the joint autograd node."""

    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    y: Tensor
    mean: Tensor
    var: Tensor
    total: float | Tensor
    n: int  # values per channel in this replica
    eps: float
    needs_grad: bool


def _replica_batch_norm(
    layer: _BatchNorm, x: Tensor, momentum: float, replication: _Replication, rank: int
) -> Tensor:
    """Training-mode forward of replica ``rank`` of ``layer``, synchronised with its siblings."""
    rendezvous = replication.rendezvous()
    tracking = bool(layer.track_running_stats)
    running_mean = layer.running_mean if tracking else None
    running_var = layer.running_var if tracking else None
    weight, bias, eps = layer.weight, layer.bias, float(layer.eps)
    batches = layer.num_batches_tracked if tracking else None

    if rendezvous.size == 1:
        single = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
        if batches is not None:
            batches.add_(1)
        replication.publish(layer)
        return single

    def one_value_error() -> ValueError:
        return ValueError(
            "Expected more than 1 value per channel when training, got 1 value per channel "
            f"across the {rendezvous.size} replicas of {replication.describe()} "
            f"(this replica's input size {list(x.shape)})"
        )

    with torch.no_grad():
        result = synchronized_forward(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            eps,
            momentum,
            ThreadSumGroup(rendezvous, rank).all_reduce_sum,
            one_value_error,
        )
        if batches is not None:
            batches.add_(1)
    if rank == 0:
        replication.publish(layer)

    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    record = _Record(
        x=x,
        weight=weight,
        bias=bias,
        y=result.out,
        mean=result.mean,
        var=result.var,
        total=result.total,
        n=result.local_count,
        eps=eps,
        needs_grad=needs_grad,
    )
    outputs = rendezvous.exchange(rank, record, what="join outputs for autograd", combine=_join)
    out: Tensor = outputs[rank]
    return out


def _join(records: list[_Record]) -> list[Tensor]:
    """Make the replicas' outputs the outputs of ONE autograd node (runs once, in one thread)."""
    if not any(r.needs_grad for r in records):
        return [r.y for r in records]
    tensors = [r.x for r in records] + [r.weight for r in records] + [r.bias for r in records]
    with torch.enable_grad():
        outputs = _JointBatchNorm.apply(records, *tensors)
    return list(outputs)


class _JointBatchNorm(torch.autograd.Function):
    """Identity on the precomputed outputs in forward; joint backward of all replicas.

    Inputs: every replica's ``x``, then every ``weight``, then every ``bias``.
    Outputs: every replica's normalised output.
    """

    @staticmethod
    def forward(ctx: Any, records: list[_Record], *tensors: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        size = len(records)
        ctx.size = size
        ctx.meta = [(r.mean, r.var, r.total, r.n) for r in records]
        ctx.eps = records[0].eps
        ctx.param_dtype = [
            r.weight.dtype if r.weight is not None else (r.bias.dtype if r.bias is not None else r.mean.dtype)
            for r in records
        ]
        ctx.save_for_backward(*tensors[: 2 * size])  # the xs and the weights
        return tuple(r.y for r in records)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        size = ctx.size
        saved = ctx.saved_tensors
        xs, weights = saved[:size], saved[size:]
        eps = ctx.eps
        needs = ctx.needs_input_grad[1:]
        sums = [
            local_grad_sums(grads[k], xs[k], weights[k], ctx.meta[k][0], ctx.meta[k][1], eps, ctx.meta[k][3])
            for k in range(size)
        ]
        reduced = ordered_sum([_math.pack_grad_sums(*s) for s in sums])  # replica order: reproducible
        grad_inputs: list[Tensor | None] = []
        for k in range(size):
            mean, var, total, count = ctx.meta[k]
            grad_inputs.append(
                finish_input_grad(grads[k], xs[k], weights[k], mean, var, eps, total, count, reduced)
                if needs[k]
                else None
            )
        grad_weights = [sums[k][1].to(ctx.param_dtype[k]) if needs[size + k] else None for k in range(size)]
        grad_biases = [
            sums[k][0].to(ctx.param_dtype[k]) if needs[2 * size + k] else None for k in range(size)
        ]
        return (None, *grad_inputs, *grad_weights, *grad_biases)


# ---------------------------------------------------------------------------------------------
# The CPU driver: replicate, run in threads, gather
# ---------------------------------------------------------------------------------------------


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

    Every module is copied with ``_replicate_for_data_parallel()``, so syncbn
    layers in the replicas synchronise with each other. Replica parameters are
    differentiable copies of the original parameters: the gradients of all
    replicas are summed (in replica order) into the originals' ``.grad``.
    Buffers are copied; with ``share_buffers`` replica 0 uses the original
    buffers themselves, as ``nn.DataParallel`` does on its first device.

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
    num_replicas = copies
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    params = list(network.parameters())
    param_index = {p: i for i, p in enumerate(params)}
    if params and torch.is_grad_enabled():
        flat = _Broadcast.apply(num_replicas, *params)
        param_copies = [list(flat[j * len(params) : (j + 1) * len(params)]) for j in range(num_replicas)]
    else:
        param_copies = [[p.detach() for p in params] for _ in range(num_replicas)]

    module_copies: list[list[nn.Module]] = [[] for _ in range(num_replicas)]
    try:
        for module in modules:
            for j in range(num_replicas):
                _local.call = (network, j, num_replicas)
                module_copies[j].append(module._replicate_for_data_parallel())
    finally:
        _local.call = None

    for i, module in enumerate(modules):
        for j in range(num_replicas):
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
            for key, buf in module._buffers.items():
                if buf is None:
                    replica._buffers[key] = None
                elif j == 0 and share_buffers:
                    replica._buffers[key] = buf
                else:
                    replica._buffers[key] = buf.detach().clone()
    return [module_copies[j][0] for j in range(num_replicas)]  # type: ignore[misc]


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any]) -> list[Any]:
    """Run ``replicas[k](inputs[k])`` in thread ``k``, as ``nn.DataParallel`` does.

    Each thread inherits the caller's grad mode. A tuple input is unpacked into
    positional arguments. If replicas raise, every thread is still joined (waits
    at synchronized layers are bounded) and the first exception in replica
    order is re-raised.

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
    for error in errors:
        if error is not None:
            raise error
    return results


def _gather(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs, 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_gather([out[i] for out in outputs]) for i in range(len(first)))
    raise TypeError(f"expected replica outputs that are tensors or tuples of tensors (got {type(first)})")


def data_parallel(module: nn.Module, input: Tensor, chunks: int | Sequence[int] = 2) -> Any:
    """Run ``module`` on ``input`` the way ``nn.DataParallel`` would, with threads on one device.

    The batch is split along dimension 0, each chunk runs through its own
    replica in its own thread (syncbn layers synchronise across the replicas),
    and the outputs are concatenated along dimension 0. Gradients flow back to
    ``module``'s parameters; running statistics land on ``module``.

    Args:
        module: the model.
        input: the batch, split along dimension 0.
        chunks: the number of replicas (the batch is split as evenly as
            possible, as ``torch.tensor_split`` does) or the explicit chunk
            sizes, which may be uneven and may include zeros. Default: 2.

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
