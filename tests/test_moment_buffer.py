"""The per-thread packed-moments buffer (``_math.MomentBuffer``) is reused safely.

Every synchronised forward of a channel count on a thread packs into the same
buffer. Nothing a layer keeps (statistics saved for backward, running buffers,
the count) may alias it, and threads (``nn.DataParallel``'s replicas) must not
share one. The group here sums over two members holding the same batch (the
sum doubles every value), so the expected result is ``nn.BatchNorm`` on the
batch twice over: exact in float64.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import syncbn
from syncbn.engine import _math


class TwoCopies:
    """Two members holding identical batches: the sum is twice this member's tensor."""

    size = 2
    rank = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(2)


def _pair(channels: int, seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = nn.BatchNorm2d(channels).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    ours = syncbn.SyncBatchNorm2d(channels, process_group=TwoCopies()).double()
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _grads(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out, [x, layer.weight, layer.bias], g)
    return list(grads)


def test_interleaved_layers_of_one_width_keep_their_own_statistics() -> None:
    # A's forward, then B's (same width: same buffer), then both backwards, A first.
    (a, ref_a), (b, ref_b) = _pair(5, 0), _pair(5, 1)
    gen = torch.Generator().manual_seed(2)
    xa = (torch.randn(4, 5, 3, 3, generator=gen, dtype=torch.float64) * 3 + 7).requires_grad_(True)
    xb = (torch.randn(6, 5, 2, 2, generator=gen, dtype=torch.float64) - 4).requires_grad_(True)
    ga = torch.randn(xa.shape, generator=gen, dtype=torch.float64)
    gb = torch.randn(xb.shape, generator=gen, dtype=torch.float64)
    ya, yb = a(xa), b(xb)
    got_a, got_b = _grads(a, xa, ya, ga), _grads(b, xb, yb, gb)
    # The reference: nn.BatchNorm on the batch twice over (what two identical members hold).
    for ours, ref, x, y, g, got in ((a, ref_a, xa, ya, ga, got_a), (b, ref_b, xb, yb, gb, got_b)):
        x2 = torch.cat([x.detach(), x.detach()]).requires_grad_(True)
        y2 = ref(x2)
        want = _grads(ref, x2, y2, torch.cat([g, g]))
        torch.testing.assert_close(y, y2[: x.shape[0]], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[0], want[0][: x.shape[0]], rtol=0, atol=1e-12)
        # Each member's weight/bias gradient is its share: half of the whole batch's.
        torch.testing.assert_close(got[1] * 2, want[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[2] * 2, want[2], rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.running_var, ref.running_var, rtol=0, atol=1e-12)


def test_statistics_saved_for_backward_do_not_alias_the_buffer() -> None:
    layer = syncbn.SyncBatchNorm1d(3, process_group=TwoCopies())
    x = torch.randn(8, 3, requires_grad=True)
    layer(x)
    buffer = _math.moment_buffer(3, x.device)
    base = buffer.packed.untyped_storage().data_ptr()
    for t in (layer.running_mean, layer.running_var):
        assert t.untyped_storage().data_ptr() != base
    packed = _math.pack_moments(8, torch.zeros(3), torch.ones(3), channels=3, device=x.device, buffer=buffer)
    count, stats = _math.unpack_moments(packed, 3, dtype=torch.float32, buffer=buffer)
    assert count == 8.0
    for t in stats:
        assert t.untyped_storage().data_ptr() != base


def test_threads_get_buffers_of_their_own() -> None:
    # Two threads normalising layers of one width at once (as DataParallel replicas do) each
    # get nn.BatchNorm's result on their own batch.
    start = threading.Barrier(2)
    errors: list[BaseException] = []
    # The buffers themselves, not their id()s: a thread that ended frees its thread-local buffer,
    # and a freed object's id can be reused by the other thread's.
    seen: dict[int, _math.MomentBuffer] = {}

    def work(seed: int) -> None:
        try:
            ours, ref = _pair(7, seed)
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(5, 7, 4, 4, generator=gen, dtype=torch.float64) * (seed + 1)
            start.wait()
            for _ in range(50):
                y = ours(x)
                want = ref(torch.cat([x, x]))[:5]
                torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
            seen[seed] = _math.moment_buffer(7, x.device)
            assert _math.moment_buffer(7, x.device) is seen[seed]  # one buffer per thread, kept
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(seen) == 2 and seen[3] is not seen[4]
    assert seen[3].packed.data_ptr() != seen[4].packed.data_ptr()  # both alive: distinct memory


def test_low_precision_statistics_are_float32_and_match_nn_batchnorm() -> None:
    # bfloat16/float16 on CPU: the native kernel with float32 running buffers, as nn.BatchNorm
    # with float32 parameters computes them.
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(16, 6, 5, 5, generator=gen) * 4 + 30).to(dtype)
        mean, var = _math.local_moments(x)
        assert mean.dtype == var.dtype == torch.float32
        ref = nn.BatchNorm2d(6, momentum=1.0)  # float32 parameters: running = this batch
        ref(x)
        n = x.numel() // 6
        torch.testing.assert_close(mean, ref.running_mean, rtol=0, atol=0)
        torch.testing.assert_close(var * n / (n - 1), ref.running_var, rtol=1e-6, atol=0)
        exact = x.double()
        dims = [0, 2, 3]
        torch.testing.assert_close(mean.double(), exact.mean(dims), rtol=0, atol=1e-5)
        torch.testing.assert_close(var.double(), exact.var(dims, unbiased=False), rtol=1e-4, atol=0)
