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

import argparse
import statistics
import time
from typing import Any, Callable

from _trees import add_arguments, print_one, run_trees

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
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=30)
    add_arguments(parser, repeat=5)
    args = parser.parse_args()
    if not args.src:
        print_one(_measure(args.calls, args.rounds), args.json, "{:>16}: {:7.2f} us/call")
        return
    forwarded = ["--calls", str(args.calls), "--rounds", str(args.rounds)]
    runs = run_trees(__file__, args.src, args.repeat, forwarded)
    names = list(runs[args.src[0]][0])
    print(
        f"us/call, thread CPU time, median of {args.repeat} runs x {args.rounds} rounds x {args.calls} calls"
    )
    print(f"{'':>16}  " + "  ".join(f"{src[-24:]:>24}" for src in args.src))
    for name in names:
        cells: list[Any] = [statistics.median(r[name] for r in runs[src]) for src in args.src]
        print(f"{name:>16}: " + "  ".join(f"{c:24.2f}" for c in cells))


if __name__ == "__main__":
    main()
