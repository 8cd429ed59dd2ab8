"""``python -m syncbn demo``: one conv net trained on digits three ways (:data:`RUNS`), the same start.
``global`` (one process, the whole batch) is the ground truth. Output: docs/getting-started.md."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import __version__
from ..modules import SyncBatchNorm2d
from . import _args
from ._launch import add_launch_arguments, is_main_process, launch_plan, rank_device, run_ranks
from ._output import ProgressBar, fail, format_error, format_table

RUNS = {
    "local": "BatchNorm2d per rank (DDP, no sync)",
    "syncbn": "syncbn.SyncBatchNorm2d (DDP)",
    "global": "BatchNorm2d, 1 process, global batch",
}
_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_EXTRAS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _args.add_counts(
        parser,
        {
            "--steps": (400, 1, "training steps of each run, at least 1 (default 400)"),
            "--batch": (4, 1, "images per rank per step, at least 1 (default 4)"),
        },
    )
    parser.add_argument(
        "--seed",
        type=_args.integer(-(2**63), 2**64 - 1),
        default=0,
        help="seed of the initialisation and data order (torch.manual_seed's range; default 0)",
    )
    parser.add_argument(
        "--lr",
        type=_args.real(0.0),
        default=0.05,
        help="SGD learning rate, 0 or more (momentum 0.9; default 0.05)",
    )
    add_launch_arguments(parser, "where to train")
    parser.add_argument(
        "--dtype", choices=tuple(_DTYPES), default="float64", help="model and data dtype (default float64)"
    )
    parser.add_argument(
        "--out", default="syncbn-demo", metavar="DIR", help="folder for the PNG and JSON (./syncbn-demo)"
    )
    parser.add_argument("--no-out", action="store_true", help="write no files")


def missing_extras(plot: bool = True) -> list[str]:
    """The pip names of the demo's optional dependencies that are not installed."""
    modules = ["sklearn", "matplotlib"] if plot else ["sklearn"]
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(_EXTRAS[module])
    return missing


def load_digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Digits as ``(x_train, y_train, x_test, y_test)``: images ``(N, 1, 8, 8)`` in [0, 1].

    A fixed 80/20 split (the same for every seed): 1,437 training and 360 test images.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=dtype).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    return x[:split], y[:split], x[split:], y[split:]


def make_net(norm: Any = SyncBatchNorm2d) -> nn.Module:
    """The demo's conv net (three conv + norm + ReLU blocks, then a linear layer)."""
    layers: list[nn.Module] = []
    for cin, cout, stride in ((1, 16, 1), (16, 32, 2), (32, 32, 2)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, stride=stride), norm(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def schedule(num_train: int, steps: int, global_batch: int, seed: int) -> torch.Tensor:
    """Training-image indices ``(steps, global_batch)``: shuffled epochs, one after another."""
    gen = torch.Generator().manual_seed(seed)
    need = steps * global_batch
    epochs = [torch.randperm(num_train, generator=gen) for _ in range(math.ceil(need / num_train))]
    return torch.cat(epochs)[:need].view(steps, global_batch)


def _train(
    name: str, norm: Any, config: dict[str, Any], data: tuple[torch.Tensor, ...], rank: int, world_size: int
) -> tuple[nn.Module, list[float], float]:
    """Train one run; return rank 0's (or the only) net, the global-batch losses, seconds."""
    distributed = name != "global"  # the ground truth: one process, the whole batch
    x_train, y_train = data[0], data[1]
    device = x_train.device
    torch.manual_seed(config["seed"])
    net = make_net(norm).to(device=device, dtype=x_train.dtype)
    model: nn.Module = net
    if distributed:
        with warnings.catch_warnings():
            # Newer PyTorch deprecates broadcast_buffers but advises keeping it for rank-local buffers.
            warnings.simplefilter("ignore", FutureWarning)
            model = nn.parallel.DistributedDataParallel(
                net, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
            )
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    order = schedule(len(y_train), config["steps"], config["batch"] * world_size, config["seed"])
    rows = slice(rank * config["batch"], (rank + 1) * config["batch"]) if distributed else slice(None)
    bar = ProgressBar(config["steps"], f"{name:>6}", enabled=rank == 0)
    losses: list[float] = []
    start = time.perf_counter()
    for step, idx in enumerate(order, 1):
        mine = idx[rows].to(device)
        loss = nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if distributed:  # equal shards: the mean of the ranks' means is the global batch's mean
            dist.all_reduce(value)
            value /= world_size
        losses.append(value.item())
        bar.update(step, f"loss {losses[-1]:.4f}")
    return net, losses, time.perf_counter() - start


def _evaluate(net: nn.Module, data: tuple[torch.Tensor, ...]) -> dict[str, float]:
    x_test, y_test = data[2], data[3]
    net.eval()
    with torch.no_grad():
        logits = net(x_test)
    return {
        "test_accuracy": (logits.argmax(1) == y_test).double().mean().item(),
        "test_loss": nn.functional.cross_entropy(logits, y_test).item(),
    }


def _state(net: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k: v.detach().cpu() for k, v in net.named_parameters()}
    return params, {k: v.detach().cpu() for k, v in net.named_buffers()}


def _diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}


def _demo_rank(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any] | None:
    """All three runs; runs 1 and 2 on every rank, run 3 on rank 0. Rank 0 returns the results."""
    device = rank_device(config["device"])
    data = tuple(t.to(device) for t in load_digits(_DTYPES[config["dtype"]]))
    nets: dict[str, nn.Module] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, norm in (("local", nn.BatchNorm2d), ("syncbn", SyncBatchNorm2d), ("global", nn.BatchNorm2d)):
        if name == "global" and rank != 0:
            return None
        net, losses, seconds = _train(name, norm, config, data, rank, world_size)
        nets[name] = net
        results[name] = {"losses": losses, "seconds": seconds, **_evaluate(net, data)}

    truth_params, truth_buffers = _state(nets["global"])
    tail = max(1, config["steps"] // 10)
    for name, result in results.items():
        params, buffers = _state(nets[name])
        result["label"] = RUNS[name]
        result["final_train_loss"] = sum(result["losses"][-tail:]) / tail
        by_name = _diffs(params, truth_params)
        result["max_param_diff"] = max(by_name.values(), default=0.0)
        result["max_buffer_diff"] = max(_diffs(buffers, truth_buffers).values(), default=0.0)
        result["param_diff_by_name"] = by_name
    results["global"]["max_param_scale"] = max(v.abs().max().item() for v in truth_params.values())
    return {"runs": results, "world_size": world_size, "loss_tail_steps": tail}


def _plot(path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    styles = {"local": ("tab:red", "-"), "syncbn": ("tab:blue", "-"), "global": ("black", "--")}
    for name, run in report["runs"].items():
        losses = run["losses"]
        window = max(1, len(losses) // 25)
        windows = [losses[max(0, i - window + 1) : i + 1] for i in range(len(losses))]
        smooth = [sum(w) / len(w) for w in windows]
        color, style = styles[name]
        steps = range(1, len(losses) + 1)
        label = f"{run['label']}: test acc {run['test_accuracy']:.1%}"
        ax.plot(steps, losses, color=color, alpha=0.15, linewidth=0.8)
        ax.plot(steps, smooth, color=color, linestyle=style, linewidth=1.8, label=label)
    cfg = report["config"]
    ax.set_title(
        f"digits, {report['world_size']} ranks x {cfg['batch']} images per step ({cfg['dtype']}); "
        f"moving average of {max(1, cfg['steps'] // 25)} steps"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _print_report(report: dict[str, Any]) -> None:
    runs = report["runs"]
    rows = []
    for name, run in runs.items():
        diff = "(reference)" if name == "global" else format_error(run["max_param_diff"])
        loss, accuracy = f"{run['final_train_loss']:.4f}", f"{run['test_accuracy']:.2%}"
        rows.append([name, run["label"], loss, accuracy, diff, f"{run['seconds']:.1f}s"])
    tail = report["loss_tail_steps"]
    headers = ["run", "", f"train loss (last {tail} steps)", "test accuracy", "max |param - global|", "time"]
    print(format_table(headers, rows, right=[False, False, True, True, True, True]))
    cfg = report["config"]
    print(
        f"\nPlain BatchNorm normalises each rank's {cfg['batch']} images on their own; syncbn normalises "
        f"all {cfg['batch'] * report['world_size']} of the global batch, as one process would: its "
        f"parameters differ from the ground truth by {format_error(runs['syncbn']['max_param_diff'])} "
        f"({cfg['dtype']} rounding), plain BatchNorm's by {format_error(runs['local']['max_param_diff'])}."
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; the main process prints the table and writes the files."""
    main = is_main_process()
    write = not args.no_out
    missing = missing_extras(plot=write)
    if missing:
        return fail(
            f"syncbn demo needs {' and '.join(missing)}: pip install 'syncbn[demo]' "
            f"(or pip install {' '.join(missing)})",
            show=main,
        )
    if write:  # here, not a type=: --no-out needs no folder, the default's included
        try:
            _args.output_dir(args.out)
        except argparse.ArgumentTypeError as exc:
            return fail(f"syncbn demo: error: argument --out: {exc}", show=main)
    plan = launch_plan("demo", args)
    if isinstance(plan, str):
        return fail(plan, show=main)
    world_size, backend = plan
    config = {key: getattr(args, key) for key in ("steps", "batch", "seed", "lr", "device")}
    config |= {"backend": backend, "dtype": args.dtype}
    if main:
        print(
            f"syncbn {__version__} demo: digits (1,437 training / 360 test 8x8 images), "
            f"{world_size} ranks x {args.batch} images = global batch {world_size * args.batch}, "
            f"{args.steps} steps, {args.dtype}, {backend} on {args.device}",
            flush=True,
        )
    start = time.perf_counter()
    try:
        result = run_ranks(_demo_rank, world_size, backend, config)
    except Exception as exc:  # noqa: BLE001 - a rank failed: say so briefly
        return fail(f"syncbn demo: a rank failed: {exc}", 1, show=main)
    if not main or result is None:
        return 0
    report = {
        "syncbn_version": __version__,
        "torch_version": torch.__version__,
        "config": config,
        "seconds": time.perf_counter() - start,
        **result,
    }
    print()
    _print_report(report)
    if write:
        os.makedirs(args.out, exist_ok=True)
        png = os.path.join(args.out, "loss_curves.png")
        path = os.path.join(args.out, "results.json")
        _plot(png, report)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {png} and {path}")
    print(f"total {report['seconds']:.1f}s", flush=True)
    return 0
