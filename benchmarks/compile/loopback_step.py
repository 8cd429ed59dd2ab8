"""Host CPU cost of a compiled training step, syncbn over a loopback group against ``nn.BatchNorm2d``.

    PYTHONPATH=/path/to/src python benchmarks/compile/loopback_step.py [--steps 20] [--rounds 10]
    python benchmarks/compile/loopback_step.py --src /work/main/src --src src   # before vs after

One process, no communication: the narrow net of ``compile_step.py`` (24 conv3x3-norm-ReLU blocks
of 16 channels, 16 images of 8x8, float32, one thread), ``torch.compile``-d (inductor) with
``nn.BatchNorm2d`` (``bn``) and with :class:`syncbn.SyncBatchNorm2d` over a loopback group (a
two-member :class:`~syncbn.groups.SumGroup` whose sum is the identity: ``syncbn``), so every step
runs the 48 calls of the compiled collective ``syncbn::all_reduce_sum`` (the framing included)
and nothing waits on another rank. What is timed is thread CPU time per step (forward,
cross-entropy, backward, SGD step), the variants taking turns for ``--rounds`` rounds of
``--steps`` steps; printed: the medians, their ratio and the extra time per collective
(``(syncbn - bn) / 48``). With several ``--src``, each runs in its own subprocess, the sources
taking turns ``--repeat`` times; printed: the median over the runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from _trees import measure_or_compare

WIDTHS, SHAPE = (16,) * 24, (16, 3, 8, 8)


def _measure(steps: int, rounds: int) -> dict[str, float]:
    import torch
    from torch import nn

    import syncbn
    from syncbn.cli._bench_e2e import conv_net
    from syncbn.cli._bench_methods import LoopbackGroup

    torch.set_num_threads(1)
    loop = LoopbackGroup()
    norms: dict[str, Callable[[int], nn.Module]] = {
        "bn": nn.BatchNorm2d,
        "syncbn": lambda c: syncbn.SyncBatchNorm2d(c, process_group=loop),
    }
    x, y = torch.randn(*SHAPE), torch.randint(0, 10, (SHAPE[0],))
    fns: dict[str, Callable[[], None]] = {}
    for name, norm in norms.items():
        torch.manual_seed(0)
        model = conv_net(norm, WIDTHS)
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(model: Callable[..., torch.Tensor] = compiled, opt: torch.optim.Optimizer = opt) -> None:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):  # compiles, warms up
            step()
        fns[name] = step
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(steps):
                start = time.thread_time_ns()
                fn()
                samples[name].append((time.thread_time_ns() - start) / 1e3)
    res = {f"{name} us/step": statistics.median(s) for name, s in samples.items()}
    res["ratio"] = res["syncbn us/step"] / res["bn us/step"]
    res["extra us/collective"] = (res["syncbn us/step"] - res["bn us/step"]) / (2 * len(WIDTHS))
    return res


def main() -> None:
    counts = {"steps": 20, "rounds": 10}
    args, medians = measure_or_compare(__file__, __doc__, counts, 2, _measure, "{:>20}: {:10.2f}")
    if medians is None:
        return
    print(f"thread CPU time, median of {args.repeat} runs x {args.rounds} rounds x {args.steps} steps")
    for src in args.src:
        print(f"{src}: " + ", ".join(f"{key} {value:.2f}" for key, value in medians[src].items()))


if __name__ == "__main__":
    main()
