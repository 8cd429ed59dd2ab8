"""Batch norm over padded sequences: statistics of the valid positions only (``mask=``).

A Conformer-style convolution module on a batch of variable-length sequences.
Run with::

    python examples/masked_sequences.py                        # one process
    torchrun --nproc-per-node 2 examples/masked_sequences.py   # statistics over both ranks' valid frames
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import syncbn


class ConvModule(nn.Module):
    """Pointwise conv, GLU, depthwise conv, masked batch norm, SiLU, pointwise conv."""

    def __init__(self, channels: int, kernel: int = 15) -> None:
        super().__init__()
        self.pointwise1 = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise = nn.Conv1d(channels, channels, kernel, padding=kernel // 2, groups=channels)
        self.norm = syncbn.SyncBatchNorm1d(channels)
        self.pointwise2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: (N, C, L); mask: (N, L), True at real frames
        x = nn.functional.glu(self.pointwise1(x), dim=1)
        x = self.depthwise(x * mask[:, None])  # padded frames do not leak into the convolution
        x = nn.functional.silu(self.norm(x, mask=mask))  # padded frames: no effect on the statistics
        return self.pointwise2(x) * mask[:, None]


def main() -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(20, 100, (8,), generator=g)
    x = torch.randn(8, 32, int(lengths.max()), generator=g)
    mask = torch.arange(x.shape[2])[None, :] < lengths[:, None]

    module = ConvModule(32)
    out = module(x, mask)
    out.square().sum().backward()
    print(f"rank {rank}: {int(mask.sum())} valid frames of {mask.numel()}; output {tuple(out.shape)}")
    print(f"rank {rank}: running_mean[:3] {module.norm.running_mean[:3].tolist()}")  # the same on every rank
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
