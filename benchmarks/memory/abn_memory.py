"""Whole-model memory of in-place activated batch norm (issue 21), run by ``memory.py --models``.

Models (float32, CPU, one thread):

* ``resnet``: a ResNet-50-style pre-activation bottleneck network (stages of 3, 4, 6, 3 bottleneck
  blocks, widths 64-512 divided by 4, expansion 4, leaky_relu 0.01), 3x128x128 input. Each block is
  ``norm-act -> conv1x1 -> norm-act -> conv3x3 -> norm-act -> conv1x1 (+ shortcut)``, the
  layout of the InPlace-ABN paper's ResNet/ResNeXt models; the in-place variant clones the block
  input for an identity shortcut (its norm-act overwrites the input), a temporary never saved.
* ``deeplab``: a DeepLab-v3-style ASPP head on a 256x64x64 feature map (a 512x512 image at output
  stride 8): 1x1 and three atrous 3x3 branches (rates 6, 12, 18) and image pooling, 128 channels
  each, concatenated, then 1x1 and 3x3 conv-norm-act and a 21-class classifier.

Variants: ``standard`` (``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)``), ``abn`` (the
package's ``ABN``: batch norm, then the activation in place on its output) and ``inplace``
(``InPlaceABN``, local). Timed as well, the synchronised code paths over a loopback group of two
whose sum is the identity (the whole synchronised path in one process): ``syncbn``
(``SyncBatchNorm2d`` + ``nn.LeakyReLU(inplace=True)``) and ``inplace-sync`` (``InPlaceABNSync``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from syncbn import SyncBatchNorm2d
from syncbn.cli.bench import LoopbackGroup
from syncbn.compat.inplace_abn import ABN, InPlaceABN, InPlaceABNSync

VARIANTS = ("standard", "abn", "inplace")
# Timed too: the synchronised code paths (a loopback group of two whose sum is the identity).
SYNC_VARIANTS = ("syncbn", "inplace-sync")


def norm_act(kind: str, channels: int, activation: str = "leaky_relu") -> nn.Module:
    """One BatchNorm + activation block of the given variant (marked ``_abn_block``)."""
    if kind == "standard":
        block: nn.Module = nn.Sequential(nn.BatchNorm2d(channels), nn.LeakyReLU(0.01, inplace=True))
    elif kind == "abn":
        block = ABN(channels, activation=activation)
    elif kind == "inplace":
        block = InPlaceABN(channels, activation=activation)
    elif kind == "syncbn":
        bn = SyncBatchNorm2d(channels, process_group=LoopbackGroup())
        block = nn.Sequential(bn, nn.LeakyReLU(0.01, inplace=True)) if activation != "identity" else bn
    else:
        block = InPlaceABNSync(channels, activation=activation, group=LoopbackGroup())
    block._abn_block = True  # type: ignore[assignment]
    return block


class Bottleneck(nn.Module):
    def __init__(self, kind: str, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.in_place = kind.startswith("inplace")
        self.bn0 = norm_act(kind, cin)
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = norm_act(kind, width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = norm_act(kind, width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x.clone() if self.proj is None and self.in_place else x
        a = self.bn0(x)
        if self.proj is not None:
            shortcut = self.proj(a)
        return self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(a))))) + shortcut


def resnet(kind: str) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.MaxPool2d(3, 2, 1)]
    cin = 16
    for depth, width, stride in ((3, 16, 1), (4, 32, 2), (6, 64, 2), (3, 128, 2)):
        for i in range(depth):
            layers.append(Bottleneck(kind, cin, width, stride if i == 0 else 1))
            cin = 4 * width
    layers += [norm_act(kind, cin), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 100)]
    return nn.Sequential(*layers)


class ASPP(nn.Module):
    def __init__(self, kind: str, cin: int = 256, width: int = 128, classes: int = 21) -> None:
        super().__init__()

        def branch(k: int, rate: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, width, k, 1, rate if k == 3 else 0, rate, bias=False), norm_act(kind, width)
            )

        self.branches = nn.ModuleList([branch(1, 1), branch(3, 6), branch(3, 12), branch(3, 18)])
        self.pool = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, width, 1, bias=False), norm_act(kind, width)
        )
        self.project = nn.Sequential(nn.Conv2d(5 * width, width, 1, bias=False), norm_act(kind, width))
        self.head = nn.Sequential(nn.Conv2d(width, width, 3, 1, 1, bias=False), norm_act(kind, width))
        self.classifier = nn.Conv2d(width, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        pooled = self.pool(x).expand(-1, -1, x.shape[2], x.shape[3])
        cat = torch.cat([b(x) for b in self.branches] + [pooled], 1)
        return self.classifier(self.head(self.project(cat)))


MODELS: dict[str, tuple[Callable[[str], nn.Module], tuple[int, ...]]] = {
    "resnet": (resnet, (3, 128, 128)),
    "deeplab": (ASPP, (256, 64, 64)),
}


def _model(name: str, kind: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    build, shape = MODELS[name]
    return build(kind).train(), shape


def _step(model: nn.Module, x: Tensor) -> None:
    out = model(x)
    out.backward(torch.ones_like(out) / out.numel())


def saved_bytes(name: str, kind: str, batch: int) -> dict[str, float]:
    """Activation bytes saved for backward (each storage once, parameters excluded), and the blocks' share."""
    model, shape = _model(name, kind)
    x = torch.randn(batch, *shape)
    saved: dict[int, int] = {}
    in_block: dict[int, int] = {}
    depth = [0]

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    for m in model.modules():
        if getattr(m, "_abn_block", False):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            if depth[0]:
                in_block[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return {"saved_bytes": float(sum(saved.values())), "block_saved_bytes": float(sum(in_block.values()))}


def peak_bytes(name: str, kind: str, batch: int) -> float:
    """Peak bytes allocated during one training step (profiler allocation events), after a warm-up."""
    model, shape = _model(name, kind)
    x = torch.randn(batch, *shape)
    _step(model, x)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, x)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"] if mem else 0
    return float(max((m["Total Allocated"] for m in mem), default=base) - base)


def child_rss(name: str, kind: str, batch: int) -> dict[str, float]:
    """Peak RSS of a fresh process that builds the model and runs one training step."""
    # The child resets its RSS high-water mark (VmHWM, /proc/self/clear_refs) after building the
    # model and its input, so the mark is the step's own peak: RSS at the start plus what it grew.
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[4]); import abn_memory as m; "
        "torch.set_num_threads(1); model, shape = m._model(sys.argv[1], sys.argv[2]); "
        "x = torch.randn(int(sys.argv[3]), *shape); before = m._status('VmRSS'); "
        "open('/proc/self/clear_refs', 'w').write('5'); m._step(model, x); print(before, m._status('VmHWM'))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", code, name, kind, str(batch), here], capture_output=True, text=True, check=True
    )
    before, after = (float(v) for v in proc.stdout.split())
    return {"rss_peak_bytes": after, "rss_step_bytes": after - before}


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def largest_batch(name: str, kind: str, cap: float, batches: list[int], peaks: list[float]) -> int:
    """The largest per-rank batch whose step peak stays under ``cap``: a linear fit, then checked."""
    n = len(batches)
    mb, mp = sum(batches) / n, sum(peaks) / n
    slope = sum((b - mb) * (p - mp) for b, p in zip(batches, peaks)) / sum((b - mb) ** 2 for b in batches)
    guess = max(1, int((cap - (mp - slope * mb)) / slope))
    while guess > 1 and peak_bytes(name, kind, guess) > cap:
        guess -= 1
    while peak_bytes(name, kind, guess + 1) <= cap:
        guess += 1
    return guess


def step_times(name: str, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds of one training step per variant, the variants interleaved."""
    setups = {}
    for kind in VARIANTS + SYNC_VARIANTS:
        model, shape = _model(name, kind)
        x = torch.randn(batch, *shape)
        _step(model, x)
        setups[kind] = (model, x)
    times: dict[str, list[float]] = {k: [] for k in setups}
    for _ in range(repeats):
        for kind, (model, x) in setups.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(model, x)
            times[kind].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    # The fastest step of each variant too: on a loaded machine the least disturbed run.
    medians.update({f"{k}_min": min(v) for k, v in times.items()})
    return medians


def main_models(batches: list[int], repeats: int, json_path: str | None) -> int:
    torch.set_num_threads(1)
    report: dict[str, Any] = {"loadavg": open("/proc/loadavg").read().split()[:3], "models": {}}
    for name in MODELS:
        rec: dict[str, Any] = {"batches": batches, "variants": {}}
        for kind in VARIANTS:
            rows = []
            for b in batches:
                row = {"batch": b, **saved_bytes(name, kind, b), "peak_bytes": peak_bytes(name, kind, b)}
                rows.append(row)
            rec["variants"][kind] = {"rows": rows, **child_rss(name, kind, max(batches))}
        cap = rec["variants"]["standard"]["rows"][-1]["peak_bytes"]
        rec["cap_bytes"] = cap
        for kind in VARIANTS:
            peaks = [r["peak_bytes"] for r in rec["variants"][kind]["rows"]]
            rec["variants"][kind]["largest_batch"] = largest_batch(name, kind, cap, batches, peaks)
        rec["step_s"] = step_times(name, max(batches), repeats)
        rec["sync_saved_bytes"] = {
            k: saved_bytes(name, k, min(batches))["saved_bytes"] for k in SYNC_VARIANTS
        }
        report["models"][name] = rec
        _print(name, rec)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {json_path}")
    print(f"load average: {' '.join(report['loadavg'])}")
    return 0


def _cells(*values: Any) -> str:
    return "| " + " | ".join(str(v) for v in values) + " |"


def _print(name: str, rec: dict[str, Any]) -> None:
    std = rec["variants"]["standard"]
    mib = 2**20
    print(f"\n{name}: per-rank batch {rec['batches']}; MiB; ratios to standard")
    print(
        _cells(
            "variant", "batch", "saved", "saved ratio", "blocks saved", "blocks ratio", "peak", "peak ratio"
        )
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in VARIANTS:
        for row, ref in zip(rec["variants"][kind]["rows"], std["rows"]):
            print(
                _cells(
                    kind,
                    row["batch"],
                    f"{row['saved_bytes'] / mib:.1f}",
                    f"{row['saved_bytes'] / ref['saved_bytes']:.3f}",
                    f"{row['block_saved_bytes'] / mib:.1f}",
                    f"{row['block_saved_bytes'] / ref['block_saved_bytes']:.3f}",
                    f"{row['peak_bytes'] / mib:.1f}",
                    f"{row['peak_bytes'] / ref['peak_bytes']:.3f}",
                )
            )
    b = max(rec["batches"])
    print(f"\ncap = standard's step peak at batch {b}: {rec['cap_bytes'] / mib:.1f} MiB")
    print(
        _cells(
            "variant",
            f"peak RSS at batch {b}",
            "RSS growth in the step",
            "largest batch under cap",
            "vs standard",
        )
        + " step s | step ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in VARIANTS:
        v = rec["variants"][kind]
        print(
            _cells(
                kind,
                f"{v['rss_peak_bytes'] / mib:.0f}",
                f"{v['rss_step_bytes'] / mib:.0f}",
                v["largest_batch"],
                f"{v['largest_batch'] / std['largest_batch']:.2f}x",
                f"{rec['step_s'][kind]:.3f}",
                f"{rec['step_s'][kind] / rec['step_s']['standard']:.3f}",
            )
        )
    sync = rec["step_s"]
    fastest = {k: sync[f"{k}_min"] / sync["standard_min"] for k in VARIANTS + SYNC_VARIANTS}
    print(
        "fastest step, ratio to standard's fastest: " + ", ".join(f"{k} {v:.3f}" for k, v in fastest.items())
    )
    print(
        f"synchronised paths (loopback group): step s syncbn+act {sync['syncbn']:.3f}, inplace-sync "
        f"{sync['inplace-sync']:.3f}, ratio "
        f"{sync['inplace-sync'] / sync['syncbn']:.3f}; saved bytes at batch "
        f"{min(rec['batches'])}: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rec["sync_saved_bytes"].items())
    )
