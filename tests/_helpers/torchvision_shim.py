"""Let the registry's CUDA build of torchvision import next to a CPU torch (tests only).

torchvision's compiled operators are missing from a CPU torch, and its import
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``, which
fails when no such operator exists. Defining the two schemas first lets the
pure-Python parts (models, transforms) import; the operators are never called
by the models the tests build (timm and Lightning import torchvision).
Import this module before anything that imports torchvision; it is a no-op
when torchvision's operators are there.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_LIBRARY: list[torch.library.Library] = []


def install() -> None:
    """Define the missing ``torchvision::nms``/``qnms`` schemas if torchvision's operators cannot load."""
    if _LIBRARY or _native_ops_load():
        return
    lib = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        if not _has_op(name):
            lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(lib)  # the schemas live as long as the Library object


def _native_ops_load() -> bool:
    """Whether torchvision is absent or its compiled operators load (then nothing is missing)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True
    if _has_op("nms"):
        return True
    for folder in spec.submodule_search_locations:
        for name in os.listdir(folder):
            if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(folder, name))
                except (OSError, RuntimeError):
                    return False
                return _has_op("nms")
    return False


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


install()
