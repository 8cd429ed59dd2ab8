"""Where the narrow net's synchronised step goes, per collective (issue 29, item 1).

Runs on 2 gloo ranks the narrow net (24 conv3x3(32)-BN-ReLU blocks, 16 images
of 8x8 per rank, 48 collectives per step) with ``nn.BatchNorm2d`` and with
``syncbn.SyncBatchNorm2d``, changing one thing at a time (no DDP, DDP bucket
size, two torch threads, each rank pinned to a core, the shared-memory wait's
spin budget; opt-in: ``plain-compiled``, ``syncbn-compiled``,
``torch.compile(DDP(net))``), interleaved in rounds. Per collective it shows the
extra step time against nn.BatchNorm2d, split into the time outside the
collective (the layer's own eager work) and inside it: waiting for the peer,
the frame work, the exchange's arrival-to-release, and the waiting rank's
wake-up lag (columns and statistic: docs/internals/cli.md). ``--profile`` adds
torch.profiler's top operators (self CPU per step) of the net without DDP on
rank 0, with syncbn over a loopback group (its own ops, no collective waits) and
with nn.BatchNorm2d. ``shm_wait.py --step`` runs it with more wait variants::

    nice -n 10 python benchmarks/speed/breakdown.py [--rounds 3] [--steps 4] [--variants a,b] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from syncbn import SyncBatchNorm2d, groups
from syncbn._shm._spin import SpinPolicy
from syncbn.cli._bench_e2e import deep_narrow, sgd_step
from syncbn.cli._bench_methods import LoopbackGroup
from syncbn.cli._launch import run_ranks

#: name -> settings changed against the base (ddp: DDP kwargs, None = no DDP; threads; pin; spin_s; compile)
VARIANTS: dict[str, dict[str, Any]] = {}
for _norm in ("plain", "syncbn"):
    VARIANTS[_norm] = {}
    VARIANTS[f"{_norm}-noddp"] = {"ddp": None}
    VARIANTS[f"{_norm}-1bucket"] = {"ddp": {"bucket_cap_mb": 100}}
    VARIANTS[f"{_norm}-smallbuckets"] = {"ddp": {"bucket_cap_mb": 0.05}}
    VARIANTS[f"{_norm}-threads2"] = {"threads": 2}
    VARIANTS[f"{_norm}-pinned"] = {"pin": True}
    VARIANTS[f"{_norm}-compiled"] = {"compile": True}
VARIANTS["own-noddp"] = {"ddp": None}
VARIANTS["syncbn-spin0"] = {"spin_s": 0.0}
VARIANTS["syncbn-spin5ms"] = {"spin_s": 0.005}

#: the variants run by default (compiling takes minutes: opt-in)
DEFAULT = [name for name in VARIANTS if not name.endswith("compiled")]

LAYERS = 24  # BN layers of the narrow net: 2 collectives each per step


def _set_affinity(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


@contextmanager
def _settings(spec: dict[str, Any], rank: int) -> Iterator[None]:
    """Apply a variant's thread count, pinning and spin budget; restore them afterwards."""
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0)
    budget = SpinPolicy.budget
    torch.set_num_threads(spec.get("threads", 1))
    if spec.get("pin"):
        _set_affinity({sorted(cpus)[rank % len(cpus)]})
    if "spin_s" in spec:
        value = spec["spin_s"]
        SpinPolicy.budget = lambda self, now: value  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _set_affinity(cpus)
        SpinPolicy.budget = budget  # type: ignore[method-assign]


def _getcpu() -> Callable[[], int]:
    """``sched_getcpu`` (the core this thread runs on, about a microsecond); -1 where unavailable."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
        fn.restype = ctypes.c_int
        fn()
        return fn  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return lambda: -1


class _Recorder:
    """Wraps the default group's ``all_reduce_sum`` (and its exchange's) on the instance."""

    def __init__(self) -> None:
        self.outer: list[tuple[int, ...]] = []  # (entry ns, exit ns, CPU at exit)
        self.inner: list[tuple[int, ...]] = []  # (entry ns, exit ns)
        self.on = False
        self.has_inner = False

    def install(self) -> None:
        g = groups.resolve(None)
        if g is None:
            return
        g.all_reduce_sum = self._wrap(g.all_reduce_sum, self.outer, True)  # type: ignore[method-assign]
        shared = getattr(g, "_shared", None)  # connected at the first call (a private detail: optional)
        if shared is not None and hasattr(shared, "all_reduce_sum"):
            shared.all_reduce_sum = self._wrap(shared.all_reduce_sum, self.inner, False)
            self.has_inner = True

    def _wrap(self, fn: Callable[..., Any], log: list[tuple[int, ...]], cpu: bool) -> Callable[..., Any]:
        clock = time.perf_counter_ns
        where = _getcpu() if cpu else None

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = clock()
            out = fn(*args, **kwargs)
            end = clock()
            log.append((start, end) if where is None else (start, end, where()))
            return out

        return timed


def _step_fn(name: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    spec = VARIANTS[name]
    norm: Callable[[int], nn.Module] = nn.BatchNorm2d
    if name.startswith("syncbn"):
        norm = SyncBatchNorm2d
    elif name.startswith("own"):
        norm = partial(SyncBatchNorm2d, process_group=LoopbackGroup())
    torch.manual_seed(0)
    net: nn.Module = deep_narrow(norm)
    ddp = spec.get("ddp", {})
    if ddp is not None:
        net = nn.parallel.DistributedDataParallel(net, **ddp)
    return sgd_step(net, x, y, compiled=bool(spec.get("compile")))


def bare_sum(calls: int = 200, values: int = 65) -> dict[str, float]:
    """One framed sum of ``values`` float64 through ``groups.resolve(None)``, back to back (us per call)."""
    group = groups.resolve(None)
    assert group is not None
    t = torch.zeros(values, dtype=torch.float64)
    for _ in range(10):
        group.all_reduce_sum(t)
    dist.barrier()
    wall, cpu = [], []
    for _ in range(calls):
        w, c = time.perf_counter(), time.thread_time()
        group.all_reduce_sum(t)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return {"wall_us": statistics.median(wall) * 1e6, "cpu_us": statistics.mean(cpu) * 1e6}


def breakdown(
    rank: int, world_size: int, names: list[str], *, rounds: int, steps: int, warmup: int
) -> dict[str, Any] | None:
    """Run ``names`` interleaved in ``rounds`` of ``steps`` steps; rank 0 returns the figures, others None."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 3, 8, 8, generator=gen)  # 16 images of 8x8 per rank
    y = torch.randint(10, (16,), generator=gen)
    fns = {name: _step_fn(name, x, y) for name in names}
    rec = _Recorder()
    for name, fn in fns.items():  # warm-up; connects the shared memory before the wrap
        with _settings(VARIANTS[name], rank):
            for _ in range(warmup):
                fn()
    rec.install()
    times: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, list[Any]] = {n: [] for n in names}  # per step: (outer, inner) call logs
    for _ in range(rounds):
        for name, fn in fns.items():
            with _settings(VARIANTS[name], rank):
                dist.barrier()
                for _ in range(steps):
                    rec.outer.clear()
                    rec.inner.clear()
                    rec.on = name.startswith("syncbn")
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
                    rec.on = False
                    calls[name].append((list(rec.outer), list(rec.inner)))
    mine = {"times": times, "calls": calls, "bare": bare_sum(), "inner": rec.has_inner}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return _analyse(gathered, names) if rank == 0 else None


def _parts(per_rank_calls: list[list[Any]], has_inner: bool) -> dict[str, float]:
    """Split one step's collectives (every rank's log) into wait, frame, release and wake-up (us/call)."""
    outer = [c[0] for c in per_rank_calls]
    inner = [c[1] for c in per_rank_calls]
    n = min(len(o) for o in outer)
    if n == 0:
        return {}
    ranks = len(outer)
    wait = frame = release = inside = shared = 0.0
    wake_spin: list[float] = []
    wake_sleep: list[float] = []
    for i in range(n):
        last_in = max(o[i][0] for o in outer)
        for o in outer:
            inside += o[i][1] - o[i][0]
            wait += last_in - o[i][0]
        cpus = {o[i][2] for o in outer}
        shared += len(cpus) == 1 and -1 not in cpus
        if has_inner and all(len(v) > i for v in inner):
            last = max(range(ranks), key=lambda r: inner[r][i][0])
            le, lx = inner[last][i]
            release += lx - le  # the later rank's exchange: both ranks present throughout
            for r in range(ranks):
                ie, ix = inner[r][i]
                frame += (outer[r][i][1] - outer[r][i][0]) - (ix - ie)
                if r != last:
                    lag = (ix - lx) / 1e3
                    waited = (le - ie) / 1e3
                    if waited < 500:
                        wake_spin.append(lag)
                    elif waited > 2000:
                        wake_sleep.append(lag)
    k = n * ranks * 1e3  # ns -> us per call and rank
    out = {"calls": float(n), "inside_us": inside / k, "wait_us": wait / k, "shared_core": shared / n}
    if has_inner:
        out.update({"frame_us": frame / k, "release_us": release / (n * 1e3)})
        out["wake_spin_us"] = statistics.median(wake_spin) if wake_spin else float("nan")
        out["wake_sleep_us"] = statistics.median(wake_sleep) if wake_sleep else float("nan")
        out["long_waits"] = float(len(wake_sleep))
    return out


def _analyse(gathered: list[Any], names: list[str]) -> dict[str, Any]:
    step_ms = {n: max(statistics.median(g["times"][n]) for g in gathered) * 1e3 for n in names}
    has_inner = all(g["inner"] for g in gathered)
    rows: dict[str, dict[str, float]] = {}
    for n in [name for name in names if name.startswith("syncbn")]:
        per_step = [_parts(list(ranks), has_inner) for ranks in zip(*(g["calls"][n] for g in gathered))]
        per_step = [step for step in per_step if step]
        keys = per_step[0].keys() if per_step else []
        parts = {k: statistics.median(step[k] for step in per_step) for k in keys}
        suffix = n[len("syncbn") :]
        plain = step_ms.get("plain" + suffix, step_ms.get("plain"))
        row = {"step_ms": step_ms[n], "plain_ms": plain if plain else float("nan")}
        if plain:
            row["ratio"] = step_ms[n] / plain
            row["extra_per_collective_us"] = (step_ms[n] - plain) * 1e3 / (2 * LAYERS)
        row.update(parts)
        if plain and "inside_us" in parts:
            row["outside_us"] = row["extra_per_collective_us"] - parts["inside_us"]
        rows[n] = row
    own = None
    if "own-noddp" in step_ms and "plain-noddp" in step_ms:
        own = (step_ms["own-noddp"] - step_ms["plain-noddp"]) * 1e3 / (2 * LAYERS)
    bare = {k: statistics.mean(g["bare"][k] for g in gathered) for k in gathered[0]["bare"]}
    return {
        "step_ms": step_ms,
        "rows": rows,
        "own_work_per_collective_us": own,
        "bare_sum": bare,
        "load": list(os.getloadavg()),
    }


def format_breakdown(res: dict[str, Any]) -> str:
    """The breakdown as text: step times, then per collective (us) for each syncbn variant."""
    lines = ["load average " + " ".join(f"{v:.2f}" for v in res["load"])]
    lines.append(
        "step ms (slowest rank's median): " + ", ".join(f"{k} {v:.2f}" for k, v in res["step_ms"].items())
    )
    columns = {  # key -> heading
        "ratio": "x plain",
        "extra_per_collective_us": "extra",
        "outside_us": "outside",
        "inside_us": "inside",
        "wait_us": "wait",
        "frame_us": "frame",
        "release_us": "release",
        "wake_spin_us": "wake-spin",
        "wake_sleep_us": "wake-sleep",
        "long_waits": "waits>2ms",
        "shared_core": "same-core",
    }
    lines.append("per collective, us (48 per step):")
    lines.append(f"{'variant':>20} " + " ".join(f"{h:>10}" for h in columns.values()))
    for name, row in res["rows"].items():
        cells = [f"{row[c]:10.2f}" if c in row else f"{'-':>10}" for c in columns]
        lines.append(f"{name:>20} " + " ".join(cells))
    own = res["own_work_per_collective_us"]
    if own is not None:
        lines.append(
            "layer's own eager work without collectives (own-noddp - plain-noddp): "
            f"{own:.1f} us per collective"
        )
    bare = res["bare_sum"]
    lines.append(
        f"bare framed sum of 65 float64, back to back: {bare['wall_us']:.1f} us wall, "
        f"{bare['cpu_us']:.1f} us CPU per call"
    )
    return "\n".join(lines)


def _profile(rank: int, steps: int) -> dict[str, list[tuple[str, float, int]]]:
    """Top operators by self CPU (us per step) of the narrow net without DDP, per normalisation."""
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(10, (16,))
    out: dict[str, list[tuple[str, float, int]]] = {}
    loop = LoopbackGroup()

    def own(c: int) -> torch.nn.Module:
        return SyncBatchNorm2d(c, process_group=loop)

    # syncbn over the loopback group: its own ops, without the collectives' waits (which the
    # profiler would charge to SyncBatchNormFunction's self time).
    for name, norm in (("plain", torch.nn.BatchNorm2d), ("own", own)):
        net = deep_narrow(norm)
        for _ in range(2):
            F.cross_entropy(net(x), y).backward()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                F.cross_entropy(net(x), y).backward()
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:14]
        out[name] = [(e.key, e.self_cpu_time_total / steps, e.count // steps) for e in rows]
    return out


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    names = args.variants.split(",") if args.variants else DEFAULT
    res = breakdown(rank, world_size, names, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    prof = _profile(rank, args.profile_steps) if args.profile else None
    if rank != 0 or res is None:
        return
    print(
        f"narrow net, W={world_size} gloo ranks, 1 thread each unless named, {args.rounds} rounds x "
        f"{args.steps} steps interleaved (+{args.warmup} warm-up)"
    )
    print(format_breakdown(res))
    if prof is not None:
        for name, rows in prof.items():
            print(f"\ntorch.profiler, {name}, no DDP, rank 0: self CPU us per step (calls per step)")
            for key, us, count in rows:
                print(f"  {key:<44} {us:9.1f} ({count})")
        res["profile"] = prof
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "results": res}, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument(
        "--variants",
        default="",
        help=f"comma-separated, of: {','.join(VARIANTS)} (default: all but *-compiled)",
    )
    parser.add_argument("--profile", action="store_true", help="add torch.profiler's top operators")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args: Any = parser.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if bad:
        parser.error(f"unknown variant(s) {bad}: expected some of {list(VARIANTS)}")
    run_ranks(_rank, args.world_size, "gloo", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
