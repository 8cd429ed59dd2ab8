"""The row each rank contributes to a consistency check: its fields, their codes, their words.

A field holds a float64 equal on every rank that agrees (a hash, a code or the value itself); a
disagreement reads back through that field's describer. See docs/internals/layers.md."""

from __future__ import annotations

import functools
import math
import zlib
from typing import Callable

import torch
from torch import Tensor, nn

# The layer's settings the ranks must share, read by name (a layer without one reads "not set"):
# a different value on one rank gives per-rank outputs or running statistics, silently.
SETTINGS = ("eps", "momentum", "r_max", "d_max", "activation", "activation_param")
FIELDS = (
    ("identity", "call", "phase", "channels", "dtype", "config", "nonfinite", "index", "class")
    + SETTINGS
    + ("stats",)
)
_NOT_SET = -math.inf  # a setting the layer does not have (None reads NaN)
# Activation names every rank can decode from their CRC-32 in a message (others: their code).
_TEXTS = ("identity", "leaky_relu", "elu", "relu", "none")
_PHASES = {1.0: "forward", 2.0: "backward"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _identity_hash(text: str) -> float:
    return float(zlib.crc32(text.encode()))


def _dtype_code(dtype: torch.dtype) -> float:
    return float(_DTYPES.index(dtype) + 1) if dtype in _DTYPES else 99.0


def _dtype_from_code(code: float) -> str:
    i = int(code) - 1 if math.isfinite(code) else -1
    return str(_DTYPES[i]) if 0 <= i < len(_DTYPES) else "another dtype"


def _config_code(layer: nn.Module | None, ndim: int) -> float:
    if layer is None:
        return float(ndim)
    bits = (
        int(getattr(layer, "affine", False))
        | int(getattr(layer, "track_running_stats", False)) << 1
        | int(getattr(layer, "momentum", 0.1) is None) << 2
    )
    return float(ndim * 8 + bits)


def _describe_config(code: float) -> str:
    if not math.isfinite(code):
        return f"an unreadable configuration ({code})"
    ndim, bits = divmod(int(code), 8)
    return (
        f"{ndim}D input, affine={bool(bits & 1)}, track_running_stats={bool(bits & 2)}, "
        f"momentum={'None' if bits & 4 else 'set'}"
    )


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_code(layer: nn.Module | None) -> float:
    """CRC-32 of the layer's class's qualified name (equal on every rank for one class), 0 without one."""
    return 0.0 if layer is None else _identity_hash(_class_name(type(layer)))


def _describe_class(code: float) -> str:
    """The class a code names: a subclass of ``nn.Module`` loaded in this process (error path only)."""
    if code == 0.0:
        return "no layer (a functional call)"
    todo, seen = [nn.Module], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if _identity_hash(_class_name(cls)) == code:
            return _class_name(cls)
        todo.extend(cls.__subclasses__())
    return f"a class not loaded on this rank (code {_whole(code)})"


def _setting_code(layer: nn.Module | None, name: str) -> float:
    """A layer setting as a float64: numbers as they are, None NaN, a string its CRC-32."""
    value = _NOT_SET if layer is None else getattr(layer, name, _NOT_SET)
    if value is None:
        return math.nan
    if isinstance(value, str):
        return _identity_hash(value)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # the layer's own checks name such a value
        return math.nan


def _show_setting(name: str, code: float) -> str:
    if code == _NOT_SET:
        return f"no {name}"
    if math.isnan(code):
        return f"{name}=None"
    if name == "activation":
        texts = {_identity_hash(t): t for t in _TEXTS}
        return f"{name}={texts[code]!r}" if code in texts else f"{name} with CRC-32 {_whole(code)}"
    return f"{name}={code!r}"


def _same(a: float, b: float) -> bool:
    """Equal, NaN (a setting of None) included."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _stats_code(layer: nn.Module | None) -> float:
    """Debug mode: bits of :func:`_stats_fault` for the running statistics the training output reads."""
    reader = getattr(layer, "_syncbn_debug_running_stats", None)
    stats = None if reader is None else reader()
    return 0.0 if stats is None else float(_stats_fault(*stats))


def _stats_fault(running_mean: Tensor, running_var: Tensor) -> int:
    """Bits: 1 ``running_mean`` holds NaN/Inf, 2 ``running_var`` does, 4 ``running_var`` is negative."""
    flags = [~torch.isfinite(running_mean).all(), ~torch.isfinite(running_var).all(), (running_var < 0).any()]
    return sum(1 << i for i, flag in enumerate(torch.stack(flags).tolist()) if flag)  # one host read (debug)


def _describe_stats(code: float) -> str:
    bits = int(code) if math.isfinite(code) else 7
    texts = ("running_mean holds NaN or Inf", "running_var holds NaN or Inf", "running_var is negative")
    return ", ".join(text for i, text in enumerate(texts) if bits & (1 << i)) or "valid"


def _grouped(rows: list[list[float]], field: int, show: Callable[[float], str]) -> str:
    by_value: dict[float, list[int]] = {}
    for rank, row in enumerate(rows):
        by_value.setdefault(row[field], []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {r}: {show(v)}" for v, r in by_value.items())


def _whole(v: float) -> str:
    """A table value as a whole number, or as what it is when it is not one (NaN, Inf)."""
    return str(int(v)) if math.isfinite(v) else str(v)


# field -> (what the ranks disagree on, how a rank's value reads)
_DISAGREEMENTS: dict[str, tuple[str, Callable[[float], str]]] = {
    "call": (
        "how many times this layer has been called (a rank skipped or repeated a call)",
        lambda v: f"call {_whole(v)}",
    ),
    "phase": ("the phase (one rank is in forward, another in backward)", lambda v: _PHASES.get(v, "?")),
    "channels": ("the channel count", lambda v: f"{_whole(v)} channels"),
    "dtype": ("the input dtype", _dtype_from_code),
    "config": ("the layer configuration", _describe_config),
    "class": ("the layer class (build the same model on every rank)", _describe_class),
    **{
        name: (
            f"the layer's {name} (every rank must use the same value; change it alike on every rank)",
            functools.partial(_show_setting, name),
        )
        for name in SETTINGS
    },
}
