"""``syncbn doctor``'s model loading, its report (the JSON document) and the report in words. The report's
keys are documented in docs/doctor.md; the text is made from the report alone."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
from typing import Any

import torch
from torch import nn

from .. import __version__
from ._doctor_audit import NOTE, PROBLEM, SYNCHRONISED, Audit, Finding
from ._output import format_table

__all__ = ["ModelSpecError", "load_model", "build_report", "render", "finish"]


class ModelSpecError(ValueError):
    """``MODULE:FACTORY`` could not be imported or did not give an ``nn.Module``."""


def load_model(spec: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model ``MODULE:FACTORY`` names: ``FACTORY(**kwargs)``, or the module object ``FACTORY`` is."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSpecError(f"expected MODULE:FACTORY, e.g. torchvision.models:resnet50 (got {spec!r})")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ModelSpecError(f"cannot load {spec!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(target, nn.Module):
        if kwargs:
            raise ModelSpecError(f"{spec!r} is a module object, not a factory: --kwargs cannot apply")
        return target
    if not callable(target):
        raise ModelSpecError(
            f"expected {spec!r} to be a callable or an nn.Module (got {type(target).__name__})"
        )
    try:
        model = target(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the factory's own error, named
        raise ModelSpecError(f"{spec}(**{kwargs!r}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"expected {spec}() to return an nn.Module (got {type(model).__name__})")
    return model


def group_rows(
    audit: Audit, batch: int | None, world: int | None, chosen: list[int]
) -> tuple[list[dict[str, Any]], list[Finding]]:
    """Per group size: the per-group batch and the fewest values per channel any synchronised layer sees.
    ``chosen``: the group sizes the job uses (several with ``--group-size node`` over unequal machines); a
    chosen size where a layer sees fewer than 2 values per channel is a problem."""
    if batch is None:
        return [], []
    sizes = [k for k in range(1, world + 1) if world % k == 0] if world else [1, 2, 4, 8]
    sizes = sorted(set(sizes) | set(chosen))
    # Values per channel and sample of each synchronised layer that ran (spatial size 0: never short).
    spatial = [
        (math.prod(layer.input_shape[2:]), layer.name)
        for layer in audit.layers
        if layer.state == SYNCHRONISED and layer.calls and layer.input_shape
    ]
    rows, findings = [], []
    for k in sizes:
        fewest = min(((k * batch * s, name) for s, name in spatial if s), default=None)
        row: dict[str, Any] = {"group_size": k, "groups": world // k if world and world % k == 0 else None}
        row["group_batch"] = k * batch
        row["fewest_values_per_channel"], row["at_layer"] = fewest or (None, None)
        row["chosen"] = k in chosen
        rows.append(row)
        if k in chosen and fewest is not None and fewest[0] < 2:
            text = (
                f"'{fewest[1]}' sees {fewest[0]} value per channel in a group of {k} rank(s) with "
                f"{batch} sample(s) each: training raises ValueError. Fix: a per-rank batch of 2 or "
                "more, or a group_size of 2 or more"
            )
            findings.append(Finding(PROBLEM, fewest[1], text))
    return rows, findings


def build_report(
    audit: Audit,
    args: argparse.Namespace,
    world: int | None,
    chosen: list[int],
    live: dict[str, Any] | None = None,
    extra: list[Finding] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """The report as the JSON document (keys in docs/doctor.md); ``args``: the command's flags."""
    input_shape = args.input_shape
    batch = args.batch_size or (input_shape[0] if input_shape else None)
    rows, group_findings = group_rows(audit, batch, world, chosen)
    findings = [*audit.findings, *group_findings, *extra]
    layers = [dataclasses.asdict(layer) for layer in audit.layers]
    synced = [layer for layer in audit.layers if layer.state == SYNCHRONISED]
    calls = sum(layer.calls for layer in synced)
    return {
        "syncbn_version": __version__,
        "torch_version": torch.__version__,
        "model": args.model,
        "input_shape": input_shape,
        "batch_size": batch,
        "world_size": world,
        "group_size": chosen[0] if len(chosen) == 1 else chosen or None,
        "layers": layers,
        "totals": {
            "layers": len(layers),
            "synchronised": len(synced),
            "collectives": 2 * calls,
            "forward_collectives": calls,
            "backward_collectives": calls,
            "payload_bytes": sum(layer.forward_bytes + layer.backward_bytes for layer in synced),
            "framed_bytes": sum(layer.framed_bytes for layer in synced),
        },
        "group_sizes": rows,
        "live": live,
        "findings": [dataclasses.asdict(f) for f in findings],
        "problems": sum(f.severity == PROBLEM for f in findings),
    }


def _cell(value: Any) -> str:
    """A cell: ``-`` for nothing, a shape as ``AxBxC``, else the value."""
    return "-" if value is None else "x".join(map(str, value)) if isinstance(value, list) else str(value)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def render(report: dict[str, Any]) -> str:
    """The report in words: the layer table, the totals, the group sizes, the live checks, the findings."""
    lines = [f"syncbn {report['syncbn_version']} doctor: {report['model']} (torch {report['torch_version']})"]
    headers = ["layer", "class", "converts to", "C", "dtype", "input", "calls", "state", "fwd", "bwd"]
    keys = ("name", "cls", "converts_to", "channels", "dtype", "input_shape", "calls", "state")
    shown: dict[str, Any] = {"converts_to": lambda v: v or "(same)", "input_shape": _cell}
    rows = [
        [shown.get(k, str)(layer[k]) for k in keys]
        + [_kib(layer["forward_bytes"]), _kib(layer["backward_bytes"])]
        for layer in report["layers"]
    ]
    right = [False, False, False, True, False, False, True, False, True, True]
    lines.append(format_table(headers, rows, right) if rows else "no BatchNorm layer found")
    t = report["totals"]
    lines.append(
        f"{t['layers']} normalisation layers, {t['synchronised']} synchronised: per training step "
        f"{t['collectives']} all_reduce calls ({t['forward_collectives']} forward, "
        f"{t['backward_collectives']} backward), {_kib(t['payload_bytes'])} of payload "
        f"({_kib(t['framed_bytes'])} as process-group frames; less through shared memory)"
    )
    if report["group_sizes"]:
        lines.append("")
        headers = ["group_size", "groups", "per-group batch", "fewest values/channel", "at layer", ""]
        columns = ("group_size", "groups", "group_batch", "fewest_values_per_channel", "at_layer")
        rows = [
            [_cell(r[k]) for k in columns] + ["<- chosen" if r["chosen"] else ""]
            for r in report["group_sizes"]
        ]
        lines.append(format_table(headers, rows, [True, True, True, True, False, False]))
    live = report["live"]
    if live:
        lines.append("")
        lines.append(f"live: {live['world_size']} ranks, backend {live['backend']}")
        for group in live["groups"]:
            lines.append(f"  group {group['ranks']}: {group['transport']}")
        if "bound_s" in live:
            bound = "none" if live["bound_s"] is None else f"{live['bound_s']:g} s"
            broadcast = "on" if live["broadcast_buffers"] else "off"
            lines.append(
                f"  syncbn's bound {bound} ({live['bound_source']}), the process group's timeout "
                f"{live['group_timeout_s']:g} s, DDP broadcast_buffers {broadcast}"
            )
    lines.append("")
    for f in report["findings"]:
        lines.append(f"{f['severity']}: {f['message']}")
    n = report["problems"]
    notes = sum(f["severity"] == NOTE for f in report["findings"])
    lines.append(
        f"doctor: {'no problem' if n == 0 else f'{n} problem' + ('s' if n > 1 else '')}, {notes} note(s)"
    )
    return "\n".join(lines)


def finish(report: dict[str, Any], json_path: str | None, show: bool = True) -> int:
    """Print ``report`` (``show``) and write it to ``json_path``; the exit code it calls for."""
    if show:
        print(render(report), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
    return 1 if report["problems"] else 0
