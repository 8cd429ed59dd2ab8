"""Cost of the float32 input gradient for float16/bfloat16 input (issue 12).

Compares, on one thread, the input gradient as computed before the fix (one
inference-mode batch norm in the input dtype plus an ``addcmul`` in the input
dtype: both terms rounded before they cancel) with the current one
(:func:`syncbn._math.input_grad`: float32 blocks, rounded once), and a whole
synchronised layer (forward + backward through ``syncbn.parallel.data_parallel``
with two chunks) with either. Rounds are interleaved, medians reported, with
the largest error against a float64 ``nn.BatchNorm`` on the same batch.

    python benchmarks/input_grad_precision.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import syncbn
from syncbn import _math
from syncbn.parallel import data_parallel


def old_input_grad(grad_output, x, weight, mean, var, eps, count, sums):  # type: ignore[no-untyped-def]
    """The pre-fix formula, kept here only to measure against."""
    scale = (var + eps).rsqrt_()
    if weight is not None:
        scale.mul_(weight)
    corrections = _math.cast(torch.mul(sums, scale * (-1.0 / count)), mean.dtype)
    shift, slope = corrections.unbind(0)
    grad_input = torch.batch_norm(x, slope, shift, mean, var, False, 0.0, eps, False)
    return grad_input.addcmul_(grad_output, scale.view(_math.broadcast_shape(x)))


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


HEADER = (
    "| dtype | shape | step | before ms | after ms | after/before | max err before | after | nn.BatchNorm |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def measure(dtype: torch.dtype, shape: tuple[int, ...], rounds: int, new_input_grad: Any) -> list[str]:
    """The table rows of one dtype and shape: medians over interleaved rounds, and the errors."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    g = torch.rand(shape, generator=gen).to(dtype)  # mean 0.5, as in issue 12: the terms cancel
    channels = shape[1]
    weight = torch.rand(channels, generator=gen) + 0.5
    var, mean = torch.var_mean(x.float(), [0, 2, 3], correction=0)
    count = float(x.numel() // channels)
    s1, s2 = _math.backward_sums(g, x, weight, mean, var, 1e-5)
    sums = torch.stack([s1, s2])
    repeat = max(3, int(2e6 // x.numel()))
    bn = syncbn.SyncBatchNorm2d(channels)

    def layer() -> None:
        xs = x.detach().requires_grad_()
        data_parallel(bn, xs, chunks=2).backward(g)

    ref_x = x.double().requires_grad_()
    torch.nn.BatchNorm2d(channels).double()(ref_x).backward(g.double())
    nn_x = x.clone().requires_grad_()
    torch.nn.BatchNorm2d(channels)(nn_x).backward(g)
    nn_err = (nn_x.grad.double() - ref_x.grad).abs().max().item()
    impls = (("before", old_input_grad), ("after", new_input_grad))
    errs = {}
    for name, fn in impls:
        _math.input_grad = fn
        xs = x.clone().requires_grad_()
        data_parallel(bn, xs, chunks=2).backward(g)
        errs[name] = (xs.grad.double() - ref_x.grad).abs().max().item()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, fn in impls:
            times.setdefault(("input_grad", name), []).append(
                timed(lambda fn=fn: fn(g, x, weight, mean, var, 1e-5, count, sums), repeat)
            )
            _math.input_grad = fn
            times.setdefault(("layer fwd+bwd", name), []).append(timed(layer, max(1, repeat // 4)))
    _math.input_grad = new_input_grad
    rows = []
    for step in ("input_grad", "layer fwd+bwd"):
        before = statistics.median(times[(step, "before")])
        after = statistics.median(times[(step, "after")])
        rows.append(
            f"| {str(dtype)[6:]} | {tuple(shape)} | {step} | {before:.3f} | {after:.3f} | "
            f"{after / before:.2f} | {errs['before']:.2e} | {errs['after']:.2e} | {nn_err:.2e} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    new_input_grad = _math.input_grad
    print(HEADER)
    for dtype in (torch.float16, torch.bfloat16):
        for shape in [(16, 64, 32, 32), (32, 256, 8, 8), (8, 16, 8, 8)]:
            for row in measure(dtype, shape, args.rounds, new_input_grad):
                print(row)


if __name__ == "__main__":
    main()
