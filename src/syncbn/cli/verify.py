"""``python -m syncbn verify``: the test suite's equivalence matrix (:mod:`._checks`) on this machine. Exit
code 0 when every case passes, 1 otherwise, 2 for a usage error. See docs/getting-started.md."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import __version__, groups
from . import _args
from ._checks import EXACT_KEYS, Case, run_case, standard_cases, tolerance
from ._launch import (
    add_launch_arguments,
    describe_transport,
    gather,
    is_main_process,
    launch_plan,
    rank_device,
    run_ranks,
)
from ._output import fail, format_error, format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    grouping = (
        "synchronise over syncbn.groups.subgroup(K): groups of K consecutive ranks, or 'node' "
        "(the ranks of each machine); each group is checked against its own batch"
    )
    add_launch_arguments(parser, "where syncbn runs", group_size_help=grouping)
    parser.add_argument(
        "--tolerance-scale",
        type=_args.real(0.0),
        default=1.0,
        metavar="FACTOR",
        help="multiply every tolerance by FACTOR, 0 or more (below 1 is stricter; default 1)",
    )
    _args.add_output(parser, "results", 60.0, "collective timeout in seconds, from 0.001 to 1e9 (default 60)")


def _check_rank(
    rank: int, world_size: int, device_name: str, group_size: int | str | None = None
) -> list[dict[str, Any]]:
    """Run the matrix on this rank; return every rank's results (gathered on all)."""
    device = rank_device(device_name)
    mine: dict[str, Any] = {}
    process_group = None if group_size is None else groups.subgroup(group_size)
    group_rank = dist.get_rank(process_group)
    for case in standard_cases(dist.get_world_size(process_group)):
        try:
            mine[case.name] = run_case(case, rank, group=process_group, group_rank=group_rank, device=device)
        except Exception as exc:  # noqa: BLE001 - reported per case
            mine[case.name] = f"{type(exc).__name__}: {exc}"
    mine[_GROUP] = groups.group_ranks(process_group)
    mine[_TRANSPORT] = describe_transport(process_group)
    return gather(mine)


_TRANSPORT = "_transport"  # not a case name: how this rank's collectives travelled
_GROUP = "_group"  # not a case name: the global ranks this rank synchronised with


def _summarise(case: Case, per_rank: list[Any], scale: float) -> dict[str, Any]:
    tol = tolerance(case) * scale
    failures: list[str] = []
    worst_key, worst = "", 0.0
    errors: dict[str, float] = {}
    for rank, result in enumerate(per_rank):
        if not isinstance(result, dict):
            failures.append(f"rank {rank}: {result}")
            continue
        for key, value in result.items():
            errors[key] = max(errors.get(key, 0.0), value)
            if key in EXACT_KEYS:
                if value != 0:
                    failures.append(f"rank {rank}: {key} = {value:g}")
                continue
            if not value <= tol:  # NaN fails too
                failures.append(f"rank {rank}: {key} error {value:.3g} > {tol:.3g}")
            if value > worst:
                worst_key, worst = key, value
    return {
        "case": case.name,
        "sizes": list(case.sizes),
        "shape": [sum(case.sizes), *case.inner],
        "dtype": str(case.dtype).removeprefix("torch."),
        "layer_dtype": str(case.layer_dtype).removeprefix("torch.") if case.layer_dtype else "",
        "memory_format": str(case.memory_format).replace("torch.", "") if case.memory_format else "",
        "errors": errors,
        "worst_key": worst_key,
        "worst_error": worst,
        "tolerance": tol,
        "passed": not failures,
        "failures": failures,
    }


def run(args: argparse.Namespace) -> int:
    """Run the checks; print the table on the main process; 0 when all pass."""
    plan = launch_plan("verify", args)
    if isinstance(plan, str):
        return fail(plan)
    world_size, backend = plan
    group_size = args.group_size
    main = is_main_process()
    if main:
        grouping = "" if group_size is None else f" in groups of subgroup({group_size!r})"
        print(
            f"syncbn {__version__} verify: {world_size} ranks{grouping}, backend {backend}, "
            f"device {args.device}, torch {torch.__version__}",
            flush=True,
        )
    start = time.perf_counter()
    try:
        per_rank = run_ranks(
            _check_rank, world_size, backend, args.device, group_size, timeout_s=args.timeout
        )
    except Exception as exc:  # noqa: BLE001 - a rank died or timed out: that is a failed check
        return fail(f"syncbn verify: FAILED, a rank did not finish: {exc}", 1, show=main)
    elapsed = time.perf_counter() - start
    sizes = [len(r[_GROUP]) for r in per_rank]
    cases = standard_cases(min(sizes, default=world_size))
    missing = "no result (its group has another size)"
    summaries = [
        _summarise(c, [r.get(c.name, missing) for r in per_rank], args.tolerance_scale) for c in cases
    ]
    passed = sum(s["passed"] for s in summaries)
    if main:
        rows = []
        for s in summaries:
            layout = s["dtype"] + (f" ({s['layer_dtype']} layer)" if s["layer_dtype"] else "")
            layout += f" {s['memory_format']}" if s["memory_format"] else ""
            shape, split = "x".join(map(str, s["shape"])), ",".join(map(str, s["sizes"]))
            worst, tol = format_error(s["worst_error"]), format_error(s["tolerance"])
            result = "PASS" if s["passed"] else "FAIL"
            rows.append([s["case"], shape, split, layout, worst, s["worst_key"] or "-", tol, result])
        headers = ["case", "global shape", "per rank", "dtype", "max error", "where", "tolerance", "result"]
        print(format_table(headers, rows, right=[False, False, False, False, True, False, True, False]))
        for s in summaries:
            for failure in s["failures"]:
                print(f"FAIL {s['case']}: {failure}")
        verdict = "all passed" if passed == len(summaries) else f"{len(summaries) - passed} FAILED"
        transport = per_rank[0][_TRANSPORT]
        print(f"{passed}/{len(summaries)} cases passed ({verdict}) in {elapsed:.1f}s", flush=True)
        print(f"collectives went through {transport}", flush=True)
        if group_size is not None:
            listed = sorted({tuple(r[_GROUP]) for r in per_rank})
            print(f"groups (global ranks): {', '.join(str(list(g)) for g in listed)}", flush=True)
        if args.json:
            report = {
                "syncbn_version": __version__,
                "torch_version": torch.__version__,
                "world_size": world_size,
                "backend": backend,
                "device": args.device,
                "tolerance_scale": args.tolerance_scale,
                "collectives": transport,
                "group_size": group_size,
                "seconds": elapsed,
                "passed": passed == len(summaries),
                "cases": summaries,
            }
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    return 0 if passed == len(summaries) else 1
