"""Small modules shared by the tests: an upstream per-channel scale, a process group that counts."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from syncbn import groups


class Scale(nn.Module):
    """A per-channel learnable scale (0.5 to 1.5), to put before a layer under test.

    Gradients then reach a parameter upstream of the layer, and an in-place layer writes over
    this module's output, never over the test's input.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight.view([1, -1] + [1] * (x.dim() - 2))


class CountingGroup(groups.ProcessGroupSum):
    """The default process group's sum, recording the size of every tensor it is handed."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[int] = []

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        self.calls.append(tensor.numel())
        return super().all_reduce_sum(tensor)
