"""The eager hot path's shortcuts give the same bits as the general path they stand in for.

The engine's training entry (``engine._function.apply``) calls ``SyncBatchNormFunction``'s C
``apply`` (bound once) and the host's input gradient writes its per-channel
temporaries into this thread's ``GradBuffer``: both must change nothing but time.
"""

from __future__ import annotations

import pytest
import torch

import syncbn
from syncbn.engine import _function
from syncbn.families import _arith


class TwoCopies:
    """Two members holding identical batches: the sum is twice this member's tensor."""

    size = 2
    rank = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(2)


def _step(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(shape[1], process_group=TwoCopies()).to(dtype)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    out = layer(x)
    out.backward(g)
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    return [out, x.grad, layer.weight.grad, layer.bias.grad, layer.running_mean, layer.running_var]


def test_c_apply_is_bound() -> None:
    assert _function._apply_c is not None  # the shortcut is taken on this torch


@pytest.mark.parametrize("shape", [(16, 32, 8, 8), (64, 128), (4, 3, 5), (3, 4, 2, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shortcuts_are_bit_identical(shape: tuple[int, ...], dtype: torch.dtype, monkeypatch) -> None:
    fast = _step(shape, dtype)
    monkeypatch.setattr(_function, "_apply_c", None)  # Function.apply's Python wrapper
    monkeypatch.setattr(_arith, "grad_buffer", lambda *args: None)  # the input gradient without it
    slow = _step(shape, dtype)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_grad_buffer_views_are_made_once() -> None:
    first = _arith.grad_buffer(5, torch.float32, 4)
    assert _arith.grad_buffer(5, torch.float32, 4) is first
    assert first.scale_view.shape == (1, 5, 1, 1)
    assert first.scale_view.data_ptr() == first.scale.data_ptr()
    assert first.slope.data_ptr() == first.corrections[1].data_ptr()


def _prepared_headers(rank: int, world_size: int) -> dict[str, object]:
    from syncbn import groups

    group = groups.ProcessGroupSum(None, shared_memory=False)  # the process group's frames
    a, b = groups.Tag(5, groups.PHASE_FORWARD), groups.Tag(6, groups.PHASE_BACKWARD)
    sums = []
    for step in range(3):  # each call site's header made once, its sequence field written per call
        for tag, n in ((a, 7), (b, 4)):
            t = torch.arange(n, dtype=torch.float64) * (rank + 1) + step
            general = t.clone().requires_grad_(False)
            group.all_reduce_sum(t, tag, deferred=False)
            group._frames(general, tag, host_wait=False, deferred=False)  # the general path, every field made
            sums.append(torch.equal(t, general))
    prepared = len(group._headers)
    try:  # the ranks make different calls: every rank raises, and the group stays usable
        group.all_reduce_sum(torch.ones(4, dtype=torch.float64), a if rank == 0 else b, deferred=False)
        error = None
    except groups.CollectiveError as exc:
        error = str(exc)
    after = group.all_reduce_sum(torch.ones(3, dtype=torch.float64), a, deferred=False)
    group.close()
    return {"equal": sums, "prepared": prepared, "error": error, "after": after.tolist()}


def test_the_prepared_frame_header_sums_and_checks_as_the_general_path() -> None:
    from _helpers.dist_harness import launch

    for result in launch(_prepared_headers, 2, timeout=60):
        assert all(result["equal"]) and len(result["equal"]) == 6
        assert result["prepared"] == 2  # one header per call site
        assert "disagree on the layer, the phase or the dtype" in (result["error"] or "")
        assert result["after"] == [2.0, 2.0, 2.0]
