"""Host cost of one call of the compiled collective ``torch.ops.syncbn.all_reduce_sum``, one process.

    PYTHONPATH=/path/to/src python benchmarks/compile/op_call.py [--calls 200] [--rounds 30]
    python benchmarks/compile/op_call.py --src /work/main/src --src src   # before vs after, interleaved

A compiled graph calls the operator as ``torch.ops.syncbn.all_reduce_sum.default(...)`` (inductor's
wrapper code). Here it runs over a loopback group (a :class:`syncbn.groups.SumGroup` of "two"
members whose sum returns its input: no communication), on a 65-element float64 tensor (a 32-channel
layer's packed moments), so what is timed is the operator's own host cost: the dispatcher, the
registration's Python layers and syncbn's framing around the sum. Variants:

* ``op``: grad mode on, the tensor not requiring grad (an inference graph);
* ``op no_grad``: under ``torch.no_grad()`` (a compiled training forward or backward);
* ``op token``: as ``op no_grad``, with a layer token (forward phase: the layer looked up);
* ``framed``: ``_ops._framed_sum`` called directly: the floor the operator's layers add to;
* ``op grad``: the tensor requires grad: the differentiable call and its adjoint's backward.

Thread CPU time, ``--calls`` calls per sample, the variants taking turns for ``--rounds`` rounds;
printed: the median per call (us). With several ``--src``, each runs in its own subprocess, the
sources taking turns ``--repeat`` times; printed: the median over the runs of each median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from _trees import measure_or_compare

VARIANTS = ("op", "op no_grad", "op token", "framed", "op grad")


def _measure(calls: int, rounds: int) -> dict[str, float]:
    import torch

    from syncbn import _checks, groups
    from syncbn.engine import _ops

    torch.set_num_threads(1)

    class Loopback:
        size, rank = 2, 0

        def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
            return t

    group = Loopback()
    handle = _ops.group_handle(group)
    op = torch.ops.syncbn.all_reduce_sum.default
    t = torch.randn(65, dtype=torch.float64)
    tg = t.clone().requires_grad_()
    g = torch.ones(65, dtype=torch.float64)
    layer = torch.nn.Identity()
    state = _checks.LayerState()
    layer._syncbn_state = state  # type: ignore[assignment]
    state.bind(layer)
    token = state.token
    other, forward = groups.PHASE_OTHER, groups.PHASE_FORWARD

    def op_call() -> None:
        op(t, handle, None, other, None, 0)

    def op_no_grad() -> None:
        with torch.no_grad():
            op(t, handle, None, other, None, 0)

    def op_token() -> None:
        with torch.no_grad():
            op(t, handle, token, forward, None, 0)

    def framed() -> None:
        _ops._framed_sum(group, t, None, other, None, 0)

    def op_grad() -> None:
        op(tg, handle, None, other, None, 0).backward(g)

    def no_grad_empty() -> None:
        with torch.no_grad():
            pass

    fns: dict[str, Callable[[], None]] = {
        "op": op_call,
        "op no_grad": op_no_grad,
        "op token": op_token,
        "framed": framed,
        "op grad": op_grad,
        "(no_grad block)": no_grad_empty,
    }
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 3):
        for name, fn in fns.items():
            start = time.thread_time_ns()
            for _ in range(calls):
                fn()
            if r >= 3:  # warm-up rounds
                samples[name].append((time.thread_time_ns() - start) / calls / 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    counts = {"calls": 200, "rounds": 30}
    args, medians = measure_or_compare(__file__, __doc__, counts, 5, _measure, "{:>16}: {:7.2f} us/call")
    if medians is None:
        return
    print(
        f"us/call, thread CPU time, median of {args.repeat} runs x {args.rounds} rounds x {args.calls} calls"
    )
    print(f"{'':>16}  " + "  ".join(f"{src[-24:]:>24}" for src in args.src))
    for name in medians[args.src[0]]:
        print(f"{name:>16}: " + "  ".join(f"{medians[src][name]:24.2f}" for src in args.src))


if __name__ == "__main__":
    main()
