"""Where a small layer's eager time beyond ``nn.BatchNorm`` goes: ATen calls, autograd, the engine's Python.

One process, one thread, no collective (a group whose sum is the identity), thread CPU time,
interleaved. Per shape, the median over rounds of one forward + backward (ms) of:

* ``local``: ``nn.BatchNorm`` (two native kernels, C++ autograd);
* ``ops``: the ATen calls syncbn's exact arithmetic makes for such a step (float32 input,
  affine, running statistics; ``docs/internals/engine.md``), replayed bare: the same kernels and
  arguments into the same reused buffers, no autograd, no engine;
* ``ops+fn``: the same calls inside a minimal Python ``autograd.Function``, its ``backward()``
  and the gradients' accumulation included: the exact arithmetic's cost with autograd;
* ``engine``: ``SyncBatchNormFunction.apply`` (syncbn's engine, as ``syncbn bench``'s ``alone``);
* ``module``: a ``syncbn.SyncBatchNorm`` layer (the layer's bookkeeping added).

``engine - ops+fn`` is the engine's own Python per step; ``ops+fn - local`` is what the exact
arithmetic's extra small operations cost (a replica of the engine's calls for measurement; the
results are not compared)::

    python benchmarks/speed/call_split.py [--shapes 8x32x8x8,64x128] [--iters 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn

import syncbn
from syncbn.cli._bench_methods import LoopbackGroup
from syncbn.engine._function import Params, SyncBatchNormFunction

EPS, MOMENTUM = 1e-5, 0.1


class _Arithmetic:
    """The exact algorithm's ATen calls for one float32 ``(N, C, *)`` shape, buffers made once."""

    def __init__(self, x: Tensor, running_mean: Tensor, running_var: Tensor) -> None:
        channels = x.shape[1]
        self.n = x.numel() // channels
        self.running = [running_mean, running_var]
        self.packed = torch.zeros(2 * channels + 1, dtype=torch.float64)
        self.sums = self.packed[1:].view(2, channels)
        self.means, self.squares = self.sums.unbind(0)
        self.stats = torch.empty(2, channels, dtype=torch.float64)
        self.stat_means, self.stat_vars = self.stats.unbind(0)
        self.empty, self.zero = torch.empty(0), torch.zeros(())
        self.scale, self.corrections = torch.empty(channels), torch.empty(2, channels)
        self.shift, self.slope = self.corrections.unbind(0)
        self.scale_view = self.scale.view([1, channels] + [1] * (x.dim() - 2))

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.n
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        torch._foreach_copy_([self.means, self.squares], [mean, var])
        self.sums.mul_(n)
        self.squares.addcmul_(self.means, mean)
        # (the collective: the identity here)
        torch.mul(self.sums, 1.0 / n, out=self.stats)
        self.stat_vars.addcmul_(self.stat_means, self.stat_means, value=-1.0).clamp_(min=0.0)
        mean32, var32 = self.stats.to(torch.float32).unbind(0)
        unbiased = var32 * (n / (n - 1))
        out = torch.empty_like(x)
        torch.native_batch_norm(
            x, weight, bias, mean32, var32, False, 0.0, EPS, out=(out, self.empty, self.empty)
        )
        torch._foreach_lerp_(self.running, [mean32, unbiased], MOMENTUM)
        return out, mean32, var32

    def backward(self, g: Tensor, x: Tensor, weight: Tensor, mean: Tensor, var: Tensor) -> tuple[Tensor, ...]:
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            g, x, weight, mean, var, None, None, False, EPS, [False, True, True]
        )
        reduced = torch.stack([sum_dy, sum_dy_xhat])  # (the collective: the identity here)
        scale = torch.add(var, EPS, out=self.scale).rsqrt_()
        scale.mul_(weight)
        torch.addcmul(self.zero, reduced, scale, value=-1.0 / self.n, out=self.corrections)
        grad_input = torch.batch_norm(x, self.slope, self.shift, mean, var, False, 0.0, EPS, False)
        return grad_input.addcmul_(g, self.scale_view), sum_dy_xhat, sum_dy


class _ArithmeticFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, arith: _Arithmetic) -> Tensor:  # type: ignore[override]
        out, mean, var = arith.forward(x, weight, bias)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.arith = arith
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        return (*ctx.arith.backward(g, x, weight, mean, var), None)


def _thread_ms(step: Callable[[], Any], iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        step()
    return (time.thread_time() - start) / iters * 1e3


def measure(spec: str, iters: int, rounds: int) -> dict[str, float]:
    shape = [int(s) for s in spec.split("x")]
    channels = shape[1]
    x = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)
    local = nn.BatchNorm2d(channels) if len(shape) == 4 else nn.BatchNorm1d(channels)
    layer = syncbn.SyncBatchNorm(channels, process_group=LoopbackGroup())
    bn = syncbn.SyncBatchNorm(channels)
    w, b = local.weight, local.bias
    arith = _Arithmetic(x.detach(), torch.zeros(channels), torch.ones(channels))
    group = LoopbackGroup()

    xd, wd, bd = x.detach(), w.detach(), b.detach()

    def ops() -> None:
        _, mean, var = arith.forward(xd, wd, bd)
        arith.backward(g, xd, wd, mean, var)

    def engine() -> None:
        params = Params(bn.running_mean, bn.running_var, EPS, MOMENTUM, group)
        SyncBatchNormFunction.apply(x, bn.weight, bn.bias, params).backward(g)

    steps: dict[str, Callable[[], Any]] = {
        "local": lambda: local(x).backward(g),
        "ops": ops,
        "ops+fn": lambda: _ArithmeticFunction.apply(x, w, b, arith).backward(g),
        "engine": engine,
        "module": lambda: layer(x).backward(g),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        _thread_ms(step, 20)
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_thread_ms(step, iters))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8x32x8x8,64x128")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for spec in args.shapes.split(","):
        m = measure(spec, args.iters, args.rounds)
        local = m["local"]
        print(f"{spec} (thread CPU ms per forward+backward, x local):")
        for name, value in m.items():
            print(f"  {name:>8} {value:.4f}  {value / local:5.2f}x")
        print(
            f"  the arithmetic in a Function beyond local BN (ops+fn - local) {m['ops+fn'] - local:.4f}; "
            f"engine's Python (engine - ops+fn) {m['engine'] - m['ops+fn']:.4f}; "
            f"layer's bookkeeping (module - engine) {m['module'] - m['engine']:.4f}"
        )


if __name__ == "__main__":
    main()
