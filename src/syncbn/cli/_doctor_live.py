"""``syncbn doctor --live``: the ranks checked against each other, under ``torchrun`` or on local ranks. One
``all_gather_object`` of every rank's layers and statistics: the same verdict, and exit code, on every rank;
only models that line up reach a synchronised collective (docs/internals/cli.md)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import groups
from ._doctor_audit import NOTE, PROBLEM, SYNCHRONISED, Finding, audit, channels, norm_layers
from ._doctor_report import ModelSpecError, build_report, finish, load_model
from ._launch import describe_transport, gather, is_main_process, launch_plan, rank_device, run_ranks
from ._output import fail

__all__ = ["run", "compare_layers", "compare_statistics"]

_MAX_LINES = 10  # problem lines per kind and rank; the rest are counted
_STATS = ("running_mean", "running_var", "num_batches_tracked")
_SAME_MODEL = "Fix: build the same model on every rank (the same config, factory and arguments)"


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """This rank's layers (name, class, channels, training) and their running statistics, on the CPU."""
    rows, stats = [], {}
    for name, layer in norm_layers(model):
        rows.append((name, type(layer).__qualname__, channels(layer), layer.training))
        stats[name] = {
            key: t.detach().cpu() for key in _STATS if isinstance(t := getattr(layer, key, None), Tensor)
        }
    return {"rows": rows, "stats": stats}


def _capped(lines: list[Finding], what: str) -> list[Finding]:
    if len(lines) <= _MAX_LINES:
        return lines
    extra = len(lines) - _MAX_LINES
    return [*lines[:_MAX_LINES], Finding(PROBLEM, "", f"... and {extra} more {what} like these")]


def compare_layers(everyone: list[dict[str, Any]]) -> list[Finding]:
    """One problem per layer that differs from rank 0's: missing, extra, other class/channels/mode, order."""
    found: list[Finding] = []
    first = {row[0]: row for row in everyone[0]["rows"]}
    for rank, theirs in enumerate(everyone[1:], start=1):
        lines: list[Finding] = []
        mine = {row[0]: row for row in theirs["rows"]}
        for name, row in first.items():
            other = mine.get(name)
            if other is None:
                text = f"rank {rank} has no layer '{name}' (rank 0 has {row[1]}({row[2]})). {_SAME_MODEL}"
            elif other[1:3] != row[1:3]:
                text = (
                    f"'{name}' is {other[1]}({other[2]}) on rank {rank} and {row[1]}({row[2]}) on rank 0: "
                    f"their sums cannot add up. {_SAME_MODEL}"
                )
            elif other[3] != row[3]:
                modes = {True: "training", False: "eval"}
                text = (
                    f"'{name}' is in {modes[row[3]]} mode on rank 0 and in {modes[other[3]]} mode on rank "
                    f"{rank}: the training ranks would wait for it at every step. Fix: the same "
                    "train()/norm_eval on every rank"
                )
            else:
                continue
            lines.append(Finding(PROBLEM, name, text))
        for name, row in mine.items():
            if name not in first:
                text = f"rank {rank} has a layer '{name}' ({row[1]}({row[2]})), rank 0 has not. {_SAME_MODEL}"
                lines.append(Finding(PROBLEM, name, text))
        common = [name for name in first if name in mine]
        theirs_order = [name for name in mine if name in first]
        if not lines and common != theirs_order:
            at = next(a for a, b in zip(common, theirs_order) if a != b)
            text = (
                f"the layers come in another order on rank {rank} than on rank 0, from '{at}'. {_SAME_MODEL}"
            )
            lines.append(Finding(PROBLEM, at, text))
        found += _capped(lines, f"differences on rank {rank}")
    return found


def compare_statistics(everyone: list[dict[str, Any]]) -> list[Finding]:
    """One problem per layer whose running statistics on some rank are not rank 0's, bit for bit."""
    found: list[Finding] = []
    for name, ours in everyone[0]["stats"].items():
        differing: list[str] = []
        for rank, theirs in enumerate(everyone[1:], start=1):
            other = theirs["stats"].get(name)
            if other is None or other.keys() != ours.keys():
                continue  # a missing layer is compare_layers' finding
            for key, t in ours.items():
                u = other[key]
                if u.shape == t.shape and not torch.equal(u, t):
                    diff = (u.double() - t.double()).abs().max().item()
                    differing.append(f"rank {rank}'s {key} by up to {diff:.3g}")
        if differing:
            text = (
                f"'{name}' has other running statistics than rank 0 ({', '.join(differing)}). Fix: load the "
                "same checkpoint on every rank, or call syncbn.sync_buffers(model) (rank 0's) before "
                "training; DistributedDataParallel copies rank 0's buffers when it wraps the model only "
                "with broadcast_buffers=True"
            )
            found.append(Finding(PROBLEM, name, text))
    return _capped(found, "layers with other statistics")


def _groups_of(audited: Any) -> list[Any]:
    """The process groups the synchronised layers of an :class:`Audit` use, in first-use order."""
    modules: dict[str, Any] = dict(norm_layers(audited.model))
    seen: list[Any] = []
    for layer in audited.layers:
        if layer.state == SYNCHRONISED:
            group = modules[layer.name]._group()  # a synchronised layer is a LayerMixin
            if not any(group is g for g in seen):
                seen.append(group)
    return seen


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's part: the checks, and the report (the same verdict on every rank)."""
    device = rank_device(args.device)
    group_size = args.group_size
    process_group = None if group_size is None else groups.subgroup(group_size)  # every rank, first
    model: nn.Module | None = None
    try:
        model = load_model(args.model, args.kwargs).to(device)
        model.train()
        mine: dict[str, Any] = {"error": None, **_snapshot(model)}
    except ModelSpecError as exc:
        mine = {"error": str(exc)}
    everyone = gather(mine)
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        return {"usage_error": "; ".join(errors)}
    assert model is not None
    extra = compare_layers(everyone)
    aligned = not extra
    extra += compare_statistics(everyone)
    # Only models that line up synchronise: a forward over layers that differ would fail mid-way.
    shape = args.input_shape if aligned else None
    result = audit(model, shape, process_group=process_group if aligned else None)
    described: list[tuple[list[int], str]] = []
    if aligned:
        for group in _groups_of(result):
            sum_group = groups.resolve(group)
            if sum_group is not None:  # the group's first collective chooses its transport
                sum_group.all_reduce_sum(torch.zeros(1, dtype=torch.float64, device=device))
            described.append((groups.group_ranks(group), describe_transport(group, device)))
    # Problems that rank 0's own audit does not show (its model differs): named with their rank.
    own = [f.message for f in result.findings if f.severity == PROBLEM]
    for r, messages in enumerate(gather(own)[1:], start=1):
        extra += [Finding(PROBLEM, "", f"rank {r}: {m}") for m in messages if m not in own]
    listed = {str(ranks): (ranks, how) for per_rank in gather(described) for ranks, how in per_rank}
    # What bounds the first collective of a DDP step of the model (DDP over the default group).
    bound = dataclasses.replace(groups.step_bound(result.model), broadcast_buffers=args.broadcast_buffers)
    if bound.outwaited:  # a problem only where the user chose the bound the broadcast outwaits
        extra.append(Finding(PROBLEM if bound.user_bound_outwaited else NOTE, "", bound.message()))
    live = {
        "world_size": world,
        "backend": dist.get_backend(),
        "groups": [{"ranks": ranks, "transport": how} for ranks, how in sorted(listed.values())],
        "bound_s": bound.bound,
        "bound_source": bound.bound_source,
        "group_timeout_s": bound.group_timeout,
        "broadcast_buffers": bound.broadcast_buffers,
        "outwaited": bound.outwaited,
    }
    sizes = sorted({len(ranks) for ranks, _ in listed.values()}) or [world]
    return build_report(result, args, world, sizes, live, extra)


def run(args: argparse.Namespace) -> int:
    """``doctor --live``: run :func:`_rank` on every rank; rank 0 (or the parent) prints the report."""
    if args.world_size is None:
        args.world_size = 2
    plan = launch_plan("doctor", args)
    if isinstance(plan, str):
        return fail(plan)
    world, backend = plan
    main = is_main_process()
    try:
        report = run_ranks(_rank, world, backend, args, timeout_s=args.timeout)
    except Exception as exc:  # noqa: BLE001 - a rank died or timed out: the check failed
        return fail(f"syncbn doctor: FAILED, a rank did not finish: {exc}", 1, show=main)
    if "usage_error" in report:
        return fail(f"syncbn doctor: {report['usage_error']}", show=main)
    return finish(report, args.json, show=main)
