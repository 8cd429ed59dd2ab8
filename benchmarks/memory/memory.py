"""Memory per layer and per model: bytes saved for backward and peak bytes of a training step.

One process (memory does not depend on the transport): syncbn runs its full
synchronised code path over a loopback group of two members whose "sum" is the
identity, the naive algorithm and ``nn.BatchNorm`` run as they are. Peak bytes
come from the PyTorch profiler's allocation events (``profile_memory=True``,
CPU allocator), saved bytes from ``torch.autograd.graph.saved_tensors_hooks``
(distinct storages). Both are reported in units of one activation (the input's
size in bytes).

    python benchmarks/memory/memory.py [--shapes 16x64x32x32,...] [--json PATH]

``--models`` (issue 21) measures whole models instead: (a) a ResNet-50-style
pre-activation bottleneck network with leaky_relu and (b) a DeepLab-style ASPP
head at high resolution, each with ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)``
("standard"), the ``inplace_abn`` package's ``ABN`` ("abn", not in place) and
syncbn's in-place ``InPlaceABNSync`` over a loopback group ("inplace", the
synchronised code path): activation bytes saved for backward (each storage once,
parameters excluded; the BN+activation blocks' share separately), peak bytes
allocated in one training step (profiler), peak RSS of a step in a fresh child
process, the largest per-rank batch whose step stays under the standard model's
peak at batch 8, and the step time ratio (interleaved, medians).

    python benchmarks/memory/memory.py --models [--batches 2,4,8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from syncbn import SyncBatchNorm
from syncbn.cli.bench import DEFAULT_SHAPES, LoopbackGroup, NaiveSyncBatchNorm, parse_shapes


def _local_bn(dim: int, channels: int) -> nn.Module:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(dim, nn.BatchNorm3d)(channels)


def build(method: str, x: Tensor) -> nn.Module:
    channels = x.shape[1]
    if method == "local":
        return _local_bn(x.dim(), channels)
    if method == "syncbn":
        return SyncBatchNorm(channels, process_group=LoopbackGroup())
    if method == "naive":
        return NaiveSyncBatchNorm(channels)
    raise ValueError(method)


def measure(method: str, shape: tuple[int, ...]) -> dict[str, float]:
    """Saved-for-backward and peak bytes of one training forward+backward, in activations."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).requires_grad_(True)
    dy = torch.randn(shape, generator=gen)
    mod = build(method, x).train()
    mod(x).backward(dy)  # warm up (lazy initialisation outside the measurement)
    x.grad = None
    mod.zero_grad(set_to_none=True)

    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod(x)
        y.backward(dy)
        del y
    act = x.numel() * x.element_size()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    # "Total Allocated" is the allocator's running total, which may include memory from
    # before this measurement: subtract the level just before the first event.
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"] if mem else 0
    peak = max((m["Total Allocated"] for m in mem), default=base) - base
    input_bytes = x.untyped_storage().nbytes()
    saved_total = sum(saved.values())
    saved_beyond_input = saved_total - (input_bytes if x.untyped_storage().data_ptr() in saved else 0)
    return {
        "activation_bytes": act,
        "peak_bytes": peak,
        "peak_activations": peak / act,
        "saved_bytes": saved_total,
        "saved_activations": saved_total / act,
        "saved_beyond_input_activations": saved_beyond_input / act,
    }


def run_memory(shapes: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    records = []
    for shape in shapes:
        rec: dict[str, Any] = {"shape": list(shape)}
        for method in ("local", "syncbn", "naive"):
            rec[method] = measure(method, shape)
        rec["syncbn_extra_saved_activations"] = (
            rec["syncbn"]["saved_activations"] - rec["local"]["saved_activations"]
        )
        rec["syncbn_extra_peak_activations"] = (
            rec["syncbn"]["peak_activations"] - rec["local"]["peak_activations"]
        )
        records.append(rec)
    return records


def format_memory(records: list[dict[str, Any]]) -> str:
    """Markdown table, in activations (one activation = the input's bytes)."""
    methods = ("local", "syncbn", "naive")
    lines = [
        "| shape | saved: local | saved: syncbn | saved: naive | peak: local | peak: syncbn | peak: naive |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        shape = "x".join(str(d) for d in rec["shape"])
        saved = " | ".join(f"{rec[m]['saved_activations']:.3f}" for m in methods)
        peak = " | ".join(f"{rec[m]['peak_activations']:.3f}" for m in methods)
        lines.append(f"| {shape} | {saved} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--models", action="store_true", help="whole models: standard BN+act vs ABN vs in-place"
    )
    parser.add_argument("--batches", default="2,4,8", help="per-rank batch sizes for --models")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant for --models")
    args = parser.parse_args(argv)
    if args.models:
        import abn_memory

        return abn_memory.main_models([int(b) for b in args.batches.split(",")], args.repeats, args.json)
    records = run_memory(args.shapes)
    print("memory per layer, float32, training forward+backward (units: one activation = the input's bytes)")
    print(format_memory(records))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": records}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
