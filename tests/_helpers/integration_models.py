"""Small models and data shared by the integration tests and their launched scripts."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 3
PER_RANK = 4  # samples per rank and step
WORLD = 2
CHANNELS = 3


class SubclassBN(nn.BatchNorm2d):
    """A BatchNorm subclass (no forward of its own): must come back as itself after revert."""


def make_net() -> nn.Module:
    """A conv net with BatchNorm 2d (plain and a subclass) and 1d, float64, fixed seed."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(CHANNELS, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3, stride=2),
        SubclassBN(5),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(5 * 3 * 3, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 2),
    ).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS global batches of WORLD * PER_RANK samples: inputs (with a large mean) and targets."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * WORLD * PER_RANK
    x = torch.randn(n, CHANNELS, 8, 8, generator=g, dtype=torch.float64) * 2.0 + 3.0
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, y


def reference_state(lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Plain BatchNorm in one process on the global batches (sample order of a DistributedSampler)."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_data()
    batch = WORLD * PER_RANK
    for step in range(STEPS):
        xb, yb = x[step * batch : (step + 1) * batch], y[step * batch : (step + 1) * batch]
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(rank: int, step: int) -> slice:
    """The samples of ``rank`` at ``step`` that make up the global batch ``step`` in order."""
    start = step * WORLD * PER_RANK + rank * PER_RANK
    return slice(start, start + PER_RANK)


def max_error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the floating-point entries of two state dicts with equal keys."""
    assert list(state) == list(ref)
    return max(float((state[k] - ref[k]).abs().max()) for k in ref if ref[k].is_floating_point())
