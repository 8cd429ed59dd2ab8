"""The offline audit of ``syncbn doctor``: what converting a model does to each of its BatchNorm layers. The
bytes counted are the engine's packing, per call of a synchronised layer in training: ``2C + 1`` float64
values forward, ``2C`` in the accumulation dtype backward. How: docs/internals/cli.md."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import convert_sync_batchnorm
from .._abn_layer import ActivatedBatchNormBase
from ..convert import _TO_SYNC
from ..engine._math import accumulation_dtype
from ..groups import FRAME
from ..groups._transport import frame_count
from ..modules import SyncBatchNorm

__all__ = ["Layer", "Finding", "Audit", "audit", "PROBLEM", "NOTE"]

PROBLEM, NOTE = "problem", "note"
# What a layer does in a training step (Layer.state).
SYNCHRONISED = "synchronised"
EVAL = "eval after train()"
FROZEN = "frozen (freeze=True)"
UNCONVERTED = "left unconverted"
FIXED = "fixed statistics"

# Members of a user's BatchNorm subclass that conversion is meant to replace.
_REPLACED = frozenset({"forward", "_check_input_dim", "_syncbn_plain_forward"})


@dataclasses.dataclass
class Layer:
    """One normalisation layer of the model: what it is, what it becomes, what it sends per step."""

    name: str
    cls: str
    converts_to: str
    channels: int
    dtype: str
    state: str
    calls: int = 1
    input_shape: list[int] | None = None
    forward_bytes: int = 0
    backward_bytes: int = 0
    framed_bytes: int = 0


@dataclasses.dataclass
class Finding:
    """A problem (the exit code becomes 1) or a note about one layer (``layer``) or the whole job (``""``)."""

    severity: str
    layer: str
    message: str


@dataclasses.dataclass
class Audit:
    """The layers, the findings and the converted model (the factory's model, converted in place)."""

    layers: list[Layer]
    findings: list[Finding]
    model: nn.Module


def norm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of each batch-norm layer (FrozenBatchNorm2d too), in ``named_modules`` order."""
    return [
        (name or "(root)", m)
        for name, m in model.named_modules()
        if isinstance(m, (_BatchNorm, ActivatedBatchNormBase))
        or ("FrozenBatchNorm" in type(m).__name__ and hasattr(m, "running_mean"))
    ]


def channels(layer: nn.Module) -> int:
    """The channels of a normalisation layer: ``num_features``, else its running mean's length."""
    count = getattr(layer, "num_features", None)
    return int(count) if isinstance(count, int) else layer.get_buffer("running_mean").numel()


def _dtype(layer: nn.Module) -> torch.dtype:
    for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False)):
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def _own_members(cls: type) -> list[str]:
    """Members that ``cls`` and its bases outside torch and syncbn define (not dunders, not replaced ones)."""
    names: list[str] = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("torch", "syncbn", "builtins"):
            continue
        names += [
            n
            for n in vars(base)
            if not (n.startswith("__") and n.endswith("__")) and n not in _REPLACED and n not in names
        ]
    return names


def dropped_members(old: type, new: type) -> list[str]:
    """What a layer of class ``old`` loses by becoming a ``new``: the members ``new`` lacks or redefines."""
    missing = object()
    return [
        n
        for n in _own_members(old)
        if inspect.getattr_static(new, n, missing) is not inspect.getattr_static(old, n)
    ]


def _payload(channels: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(forward bytes, backward bytes, both as process-group frames) of one call's two collectives."""
    forward_values, backward_values = 2 * channels + 1, 2 * channels
    backward_item = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
    framed = (frame_count(forward_values) + frame_count(backward_values)) * FRAME * 8
    return 8 * forward_values, backward_item * backward_values, framed


def _probe(model: nn.Module, shape: list[int], layers: dict[str, nn.Module]) -> dict[str, list[Any]]:
    """Run one training forward of a random ``shape`` batch; per layer name, its calls' input shapes."""
    seen: dict[str, list[Any]] = {name: [] for name in layers}
    handles = [
        layer.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(list(args[0].shape)))
        for name, layer in layers.items()
    ]
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    device, dtype = (first.device, first.dtype) if first is not None else ("cpu", torch.get_default_dtype())
    try:
        with torch.no_grad():
            model(torch.randn(shape, device=device, dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _classify(new: nn.Module, training: bool) -> str:
    if not isinstance(new, (SyncBatchNorm, ActivatedBatchNormBase)):
        return FIXED if not isinstance(new, _BatchNorm) else UNCONVERTED
    if getattr(new, "freeze", False):
        return FROZEN
    return SYNCHRONISED if training else EVAL


def _sync_class(old: type) -> str:
    """The syncbn class a plain ``old`` converts to (the one to derive a custom layer from)."""
    return next((sync.__name__ for plain, sync in _TO_SYNC if issubclass(old, plain)), "SyncBatchNorm")


def _findings_for(layer: Layer, old: type, new: nn.Module, frozen_affine: bool) -> list[Finding]:
    name, out = layer.name, []
    if layer.state == UNCONVERTED:
        text = (
            f"'{name}' ({layer.cls}) is left unconverted, so it does not synchronise: {layer.cls} "
            f"defines its own forward, which conversion would drop. Fix: derive {layer.cls} from "
            f"syncbn.{_sync_class(old)} (its forward calling super().forward synchronises), or set "
            "_syncbn_plain_forward = True on it if its forward is only batch norm's"
        )
        out.append(Finding(PROBLEM, name, text))
    elif layer.converts_to and layer.converts_to != layer.cls:
        lost = ", ".join(dropped_members(old, type(new)))
        text = (
            f"'{name}' ({layer.cls}) converts to {layer.converts_to}, which drops {layer.cls}'s {lost}. "
            f"Fix: derive {layer.cls} from syncbn.{layer.converts_to} instead of converting it, or "
            f"move {lost} out of the layer"
        )
        if lost:
            out.append(Finding(PROBLEM, name, text))
    if layer.state == SYNCHRONISED and frozen_affine:
        text = (
            f"'{name}' has weight and bias with requires_grad=False but trains: its running statistics "
            "still update, synchronised, every step. If it is meant to be frozen, keep it in eval mode "
            "(norm_eval=True) or give it freeze=True"
        )
        out.append(Finding(NOTE, name, text))
    return out


def _grouped_note(names: list[str], text: str) -> list[Finding]:
    """One note naming the first three ``names`` (none without a name)."""
    if not names:
        return []
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [Finding(NOTE, "", f"{len(names)} layer{'s' if len(names) != 1 else ''} ({shown}) {text}")]


def audit(model: nn.Module, input_shape: list[int] | None = None, process_group: Any = None) -> Audit:
    """Convert ``model`` in place (over ``process_group``) and report every normalisation layer.

    With ``input_shape`` (one rank's batch), a training forward of 2 such samples finds which layers
    run, how often and on what shape; without, each layer is taken to run once per step.
    """
    model.train()  # as a job does: a norm_eval-style train() override puts its layers in eval here
    before = [(name, type(m), m.training, _requires_no_grad(m)) for name, m in norm_layers(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each left layer is a finding below
        converted = convert_sync_batchnorm(model, process_group)
    after = dict(norm_layers(converted))
    findings: list[Finding] = []
    shapes: dict[str, list[Any]] | None = None
    if input_shape is not None:
        try:  # on 2 samples: the shapes beyond N do not depend on N, 2 keeps training possible
            shapes = _probe(converted, [2, *input_shape[1:]], after)
        except Exception as exc:  # noqa: BLE001 - reported: the shape the user gave does not fit
            text = (
                f"a training forward of a batch of shape {tuple(input_shape)} failed "
                f"({type(exc).__name__}: {exc}). Fix: pass --input-shape as the model takes its input"
            )
            findings.append(Finding(PROBLEM, "", text))
    layers: list[Layer] = []
    for name, old, training, frozen_affine in before:
        new = after.get(name)
        if new is None:  # not expected: conversion keeps every path
            continue
        dtype = _dtype(new)
        layer = Layer(
            name=name,
            cls=old.__qualname__,
            converts_to=type(new).__qualname__ if type(new) is not old else "",
            channels=channels(new),
            dtype=str(dtype).removeprefix("torch."),
            state=_classify(new, training),
        )
        if shapes is not None:
            calls = shapes.get(name, [])
            layer.calls = len(calls)
            layer.input_shape = [input_shape[0], *calls[0][1:]] if calls and input_shape else None
        if layer.state == SYNCHRONISED:
            fwd, bwd, framed = _payload(layer.channels, dtype)
            layer.forward_bytes, layer.backward_bytes = fwd * layer.calls, bwd * layer.calls
            layer.framed_bytes = framed * layer.calls
        layers.append(layer)
        findings += _findings_for(layer, old, new, frozen_affine)
    evals = [layer.name for layer in layers if layer.state == EVAL]
    findings += _grouped_note(
        evals,
        "stay in eval mode after model.train() (a norm_eval-style override): they normalise with "
        "their running statistics and never synchronise. Fine for a frozen backbone; otherwise "
        "set norm_eval=False",
    )
    unused = [layer.name for layer in layers if shapes is not None and layer.calls == 0]
    if not any(f.layer == "" and f.severity == PROBLEM for f in findings):
        findings += _grouped_note(
            unused,
            "did not run in the training forward: the same on every rank, they cost nothing; "
            "if they run on some ranks only, the others wait",
        )
    return Audit(layers, findings, converted)


def _requires_no_grad(layer: nn.Module) -> bool:
    params = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]
    return bool(params) and not any(p.requires_grad for p in params)
