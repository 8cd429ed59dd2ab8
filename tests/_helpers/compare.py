"""One step of two modules on the same input and upstream gradient, compared bit for bit."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def assert_same_step(ours: nn.Module, ref: nn.Module, x: Tensor) -> None:
    """Run ``ours`` and ``ref`` forward on copies of ``x`` and backward with one random upstream gradient.

    Asserts that the outputs and the input gradients are ``torch.equal``.

    Args:
        ours: the module under test.
        ref: the reference module.
        x: the input (copied for each module).
    """
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
