"""The hierarchical path against the flat paths: cost per layer-step, simulated or namespace machines.

Per rank, interleaved, the two sums of one layer (``2C + 1`` float64 and ``2C`` float32 values)
through:

* ``shm``: the flat shared-memory path (every rank on one machine), with the adaptive spin of
  :class:`syncbn._shm._spin.SpinPolicy`; ``shm-fixed``: the same with the earlier fixed 5 ms spin;
* ``gloo``: the process group's transport (shared memory off: the flat path across machines);
* ``hier``: the hierarchical path (machine groups through shared memory, leaders over gloo);
  ``hier-fixed``: the same with the fixed spin.

Two ways to make machines:

* simulated (default): W ranks on this machine told they sit on ``--machines`` machines
  (consecutive ranks share a host key); the leaders' gloo hop is loopback TCP, so this
  measures the path's own cost (three framed steps instead of one), not a network.
  ``--machines 1``: the flat paths only.
* ``--netns`` (root): ``--machines`` hosts built from Linux network namespaces joined by veth
  pairs (``tests/_helpers/netns.py``), each with its own hostname; gloo over real TCP between them
  (no latency emulation: the veths are as fast as the kernel). Flat there is ``gloo``.

With ``--compute N`` every rank multiplies 96x96 matrices N times before each sum, odd ranks 2N
times, so the others wait (as ranks of a training step do): the wait's spinning then costs
CPU a peer needs. Slowest rank's median, microseconds, its CPU time per step, the load average.

    python benchmarks/speed/hierarchical.py [--world-size 4] [--machines 2] [--netns] [--channels 128]
                                      [--iters 200] [--compute 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from syncbn import _shm, groups
from syncbn.cli._launch import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _fixed(group: groups.ProcessGroupSum) -> groups.ProcessGroupSum:
    """The same group with the earlier fixed 5 ms spin (after its set-up)."""
    shared = group._shared  # noqa: SLF001 - the benchmark switches the policy under test
    if shared is None and group._hier is not None and group._hier.local is not None:  # noqa: SLF001
        shared = group._hier.local._shared  # noqa: SLF001
    if shared is not None:
        shared.spin.budget = lambda now: 0.005  # type: ignore[method-assign]
    return group


def _connected(group: groups.ProcessGroupSum) -> groups.ProcessGroupSum:
    group.all_reduce_sum(torch.zeros(1, dtype=torch.float64))
    return group


def _variants(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, groups.ProcessGroupSum]:
    out: dict[str, groups.ProcessGroupSum] = {}
    if not args.netns:
        out["shm"] = _connected(groups.ProcessGroupSum(None))
        out["shm-fixed"] = _fixed(_connected(groups.ProcessGroupSum(None)))
    out["gloo"] = _connected(groups.ProcessGroupSum(None, shared_memory=False, hierarchical=False))
    if args.machines > 1:
        if not args.netns:
            key = 1000.0 + rank // (world_size // args.machines)
            _shm._host_key = lambda: key  # type: ignore[assignment]
        out["hier"] = _connected(groups.ProcessGroupSum(None, hierarchical=True))
        out["hier-fixed"] = _fixed(_connected(groups.ProcessGroupSum(None, hierarchical=True)))
        assert out["hier"].hierarchical and out["hier-fixed"].hierarchical
    return out


def _measure(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    variants = _variants(rank, world_size, args)
    fwd = torch.zeros(2 * args.channels + 1, dtype=torch.float64)
    bwd = torch.zeros(2 * args.channels, dtype=torch.float32)
    tf, tb = groups.Tag(5, groups.PHASE_FORWARD), groups.Tag(5, groups.PHASE_BACKWARD)

    work = torch.randn(96, 96)
    units = args.compute * (1 + rank % 2)  # odd ranks compute twice as long: the others wait

    def two(group: groups.ProcessGroupSum) -> Any:
        def step() -> None:
            for _ in range(units):
                torch.mm(work, work)
            group.all_reduce_sum(fwd, tf)
            for _ in range(units):
                torch.mm(work, work)
            group.all_reduce_sum(bwd, tb)

        return step

    cpu: dict[str, list[float]] = {}
    times = _rotated({k: two(g) for k, g in variants.items()}, args.iters, cpu)
    mine = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    mine.update({f"{k} cpu": statistics.median(v) * 1e6 for k, v in cpu.items()})
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    for g in variants.values():
        g.close()
    return {k: max(g[k] for g in gathered) for k in mine}


def _rotated(steps: dict[str, Any], iters: int, cpu: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each step ``10 + iters`` times after a barrier, the order rotated every round (alike on every
    rank): whichever variant follows another absorbs the skew the other leaves (ranks leave a
    collective up to a gloo latency apart), so no variant always follows the same one."""
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for it in range(10 + iters):
        for j in range(len(names)):
            name = names[(it + j) % len(names)]
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            steps[name]()
            elapsed, used = time.perf_counter() - t0, time.thread_time() - c0
            if it >= 10:
                times[name].append(elapsed)
                cpu.setdefault(name, []).append(used)
    return times


def _report(slowest: dict[str, float], args: argparse.Namespace) -> None:
    where = "namespace hosts" if args.netns else "simulated machines"
    print(
        f"W={args.world_size} as {args.machines} {where}, C={args.channels}, compute {args.compute},"
        f" {args.iters} iterations, load {os.getloadavg()[0]:.2f}: slowest rank's median us per"
        " layer-step (2 sums) / its CPU us:"
    )
    names = [k for k in slowest if not k.endswith(" cpu")]
    print("  " + "   ".join(f"{k} {slowest[k]:.0f}/{slowest[k + ' cpu']:.0f}" for k in names))
    if "hier" in slowest:
        print(f"  hier / gloo (flat across machines) = {slowest['hier'] / slowest['gloo']:.3f}")
    for base in ("shm", "hier"):
        if base in slowest:
            print(
                f"  {base} / {base}-fixed: time {slowest[base] / slowest[base + '-fixed']:.3f},"
                f" CPU {slowest[base + ' cpu'] / slowest[base + '-fixed cpu']:.3f}"
            )


def _simulated(rank: int, world_size: int, args: argparse.Namespace) -> None:
    slowest = _measure(rank, world_size, args)
    if rank == 0:
        _report(slowest, args)


def _on_namespace_host(
    rank: int, world_size: int, directory: str, args: argparse.Namespace
) -> dict[str, float]:
    return _measure(rank, world_size, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument(
        "--netns", action="store_true", help="namespace hosts (root; tests/_helpers/netns.py)"
    )
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--compute",
        type=int,
        default=0,
        help="96x96 matmuls before each sum (odd ranks twice as many: the others wait), default 0",
    )
    args = parser.parse_args(argv)
    if args.world_size % args.machines or (args.machines > 1 and args.world_size // args.machines < 2):
        parser.error("--world-size must be a multiple of --machines, with at least 2 ranks per machine")
    if not args.netns:
        run_ranks(_simulated, args.world_size, "gloo", args)
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))
    from _helpers import netns

    why = netns.available()
    if why:
        parser.error(f"--netns: {why}")
    per = args.world_size // args.machines
    with netns.Hosts(args.machines) as hosts:
        results = hosts.launch(_on_namespace_host, [per] * args.machines, args).wait(600)
    if not isinstance(results[0], dict):
        print(results[0][1], file=sys.stderr)
        return 1
    _report(results[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
