"""Model factories for ``syncbn doctor``'s tests, named as ``_helpers.doctor_models:FACTORY``, and
:func:`doctor`, which runs the command in this process.

Real model patterns (an OpenMMLab backbone of mmcv ``ConvModule`` blocks with ``norm_eval``) and
planted problems: a BatchNorm subclass with its own forward, one with extra state, ranks that
build different layers, ranks whose running statistics differ (the rank is read from
``torch.distributed`` at build time, as a factory under ``--live`` may).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn.cli import main

from . import torchvision_shim  # noqa: F401 - timm imports torchvision

MODELS = "_helpers.doctor_models"
Capture = pytest.CaptureFixture[str]


def doctor(tmp_path: Path, capsys: Capture, *argv: str) -> tuple[int, str, dict[str, Any]]:
    """Run ``syncbn doctor *argv --json``; (exit code, stdout, the JSON report)."""
    report = tmp_path / "doctor.json"
    code = main(["doctor", *argv, "--json", str(report)])
    out = capsys.readouterr().out
    return code, out, json.loads(report.read_text())


def problem_lines(out: str) -> list[str]:
    """The problem lines of the printed report."""
    return [line for line in out.splitlines() if line.startswith("problem: ")]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ScaledBN(nn.BatchNorm2d):
    """A subclass with its own forward (pytorch#41081): conversion would drop the scaling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class TaggedBN(nn.BatchNorm2d):
    """A subclass with extra state in its ``state_dict`` and a method of its own."""

    def get_extra_state(self) -> Any:
        return {"tag": "kept"}

    def set_extra_state(self, state: Any) -> None:
        self.tag = state["tag"]

    def describe(self) -> str:
        return "tagged"


def _block(cin: int, cout: int, norm: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), norm or nn.BatchNorm2d(cout), nn.ReLU())


def custom_forward() -> nn.Module:
    """A small net whose second norm layer is a :class:`ScaledBN`."""
    return nn.Sequential(_block(3, 8), _block(8, 16, ScaledBN(16)), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def extra_state() -> nn.Module:
    """A small net whose second norm layer is a :class:`TaggedBN`."""
    return nn.Sequential(_block(3, 8), _block(8, 16, TaggedBN(16)), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def clean() -> nn.Module:
    """A small net with plain BatchNorm only (identical on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(_block(3, 8), _block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def rank_dependent_layers() -> nn.Module:
    """Rank 1 builds one more block (a config differing per rank): its layers do not line up."""
    blocks = [_block(3, 8), _block(8, 16)] + ([_block(16, 16)] if _rank() == 1 else [])
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def rank_dependent_channels() -> nn.Module:
    """Rank 1's second block is wider: same layers, other channel counts."""
    width = 24 if _rank() == 1 else 16
    return nn.Sequential(_block(3, 8), _block(8, width), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def rank_dependent_stats() -> nn.Module:
    """Rank 1 loaded other running statistics for the second block's norm layer."""
    model = clean()
    if _rank() == 1:
        with torch.no_grad():
            model[1][1].running_mean.add_(0.5)
    return model


def mmcv_norm_eval() -> nn.Module:
    """An OpenMMLab-style backbone: mmcv ``ConvModule`` stages, the stem frozen, ``norm_eval=True``.

    As mmdet/mmseg backbones do: ``train()`` puts every BatchNorm back in eval when ``norm_eval``,
    and the stem's norm has ``requires_grad=False``; the neck uses ``SyncBN`` (``nn.SyncBatchNorm``).
    """
    from mmcv.cnn import ConvModule

    class Backbone(nn.Module):
        def __init__(self, norm_eval: bool = True) -> None:
            super().__init__()
            self.norm_eval = norm_eval
            frozen = dict(type="BN", requires_grad=False)
            self.stem = ConvModule(3, 8, 3, padding=1, norm_cfg=frozen)
            self.stage1 = nn.Sequential(
                ConvModule(8, 16, 3, padding=1, norm_cfg=dict(type="BN")),
                ConvModule(16, 16, 3, padding=1, norm_cfg=dict(type="BN")),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stage1(self.stem(x))

        def train(self, mode: bool = True) -> Backbone:
            super().train(mode)
            if mode and self.norm_eval:
                for m in self.modules():
                    if isinstance(m, _BatchNorm):
                        m.eval()
            return self

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = Backbone()
            self.neck = ConvModule(16, 16, 1, norm_cfg=dict(type="SyncBN"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.neck(self.backbone(x))

    return Detector()
