"""Traffic and latency of one synchronised BatchNorm layer-step as the world grows.

Per rank and per layer, one training step (forward + backward):

* syncbn: one ``all_reduce`` of ``2C + 1`` float64 values forward and one of
  ``2C`` float64 values backward, whatever W;
* ``torch.nn.SyncBatchNorm``: an ``all_gather`` of ``[mean, invstd, count]``
  (``2C + 1`` float32 values from each rank, so ``W (2C + 1)`` values land on
  every rank) forward, then an ``all_reduce`` of ``2C`` float32 values backward.

Bytes are what one rank sends (and, symmetrically, receives) under the ring
algorithms: ``2 (W-1)/W * S`` for an all_reduce of S bytes, ``(W-1) * S`` for an
all_gather of S bytes per rank. Latency uses the alpha-beta model with a per-hop
latency alpha and per-rank bandwidth B (defaults: an assumed multi-node NCCL
over 200 Gb/s InfiniBand; change them with the flags):

* ring all_reduce: ``2 (W-1) alpha + 2 (W-1)/W * S / B``
* tree all_reduce (NCCL's double binary tree): ``2 log2(W) alpha + 2 S / B``
* ring all_gather: ``(W-1) alpha + (W-1) S / B`` (NCCL's all_gather is a ring)

These are model predictions, not measurements.

A second table models CPU groups of M machines x R ranks each on gloo (TCP), per layer-step
(C = 256 by default): the bytes one machine's network link carries and the predicted time, for

* flat syncbn (today's default across machines): two ring all_reduces over all ``W = M R`` ranks;
* torch's design on the same transport: a ring all_gather of ``2C + 1`` float32 values from
  every rank forward, a ring all_reduce of ``2C`` float32 values backward;
* hierarchical syncbn (``ProcessGroupSum(hierarchical=True)``): per collective, one
  shared-memory round on each machine, a ring all_reduce over the M leaders, one shared-memory
  hand-back round.

With the ranks ordered by machine, one ring hop per machine crosses its link, so a ring
all_reduce of S bytes puts ``2 (W-1)/W * S`` on each link, a ring all_gather ``(W-1) * S``.
Every ring hop is charged the network latency (gloo's same-machine hops are TCP too).

    python benchmarks/speed/scaling.py [--alpha-us 10] [--bandwidth-gbs 25] [--gloo-alpha-us 50]
        [--gloo-bandwidth-gbs 1.25] [--shm-round-us 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

WORLD_SIZES = (2, 8, 64, 256, 1024)
CHANNELS = (64, 256, 512, 2048)
MACHINES = (2, 4, 8, 16, 32, 64)
RANKS_PER_MACHINE = (2, 8, 64)


def syncbn_traffic(world: int, channels: int) -> dict[str, float]:
    """Bytes one rank sends per layer-step and the collective count, for syncbn."""
    fwd = 8 * (2 * channels + 1)
    bwd = 8 * 2 * channels
    ring = 2 * (world - 1) / world
    return {
        "collectives": 2,
        "payload_bytes": fwd + bwd,
        "sent_bytes": ring * (fwd + bwd),
        "result_bytes_held": fwd + bwd,
    }


def torch_traffic(world: int, channels: int) -> dict[str, float]:
    """Bytes one rank sends per layer-step and the collective count, for torch.nn.SyncBatchNorm."""
    fwd = 4 * (2 * channels + 1)
    bwd = 4 * 2 * channels
    return {
        "collectives": 2,
        "payload_bytes": fwd + bwd,
        "sent_bytes": (world - 1) * fwd + 2 * (world - 1) / world * bwd,
        "result_bytes_held": world * fwd + bwd,
    }


def ring_all_reduce_s(size: float, world: int, alpha: float, beta: float) -> float:
    return 2 * (world - 1) * alpha + 2 * (world - 1) / world * size * beta


def tree_all_reduce_s(size: float, world: int, alpha: float, beta: float) -> float:
    return 2 * math.ceil(math.log2(world)) * alpha + 2 * size * beta


def ring_all_gather_s(size: float, world: int, alpha: float, beta: float) -> float:
    return (world - 1) * alpha + (world - 1) * size * beta


def latency_us(world: int, channels: int, alpha: float, beta: float) -> dict[str, float]:
    """Predicted communication time per layer-step (forward + backward), microseconds."""
    s_fwd, s_bwd = 8 * (2 * channels + 1), 8 * 2 * channels
    t_fwd, t_bwd = 4 * (2 * channels + 1), 4 * 2 * channels
    return {
        "syncbn_ring_us": 1e6
        * (ring_all_reduce_s(s_fwd, world, alpha, beta) + ring_all_reduce_s(s_bwd, world, alpha, beta)),
        "syncbn_tree_us": 1e6
        * (tree_all_reduce_s(s_fwd, world, alpha, beta) + tree_all_reduce_s(s_bwd, world, alpha, beta)),
        "torch_us": 1e6
        * (
            ring_all_gather_s(t_fwd, world, alpha, beta)
            + min(ring_all_reduce_s(t_bwd, world, alpha, beta), tree_all_reduce_s(t_bwd, world, alpha, beta))
        ),
    }


def table(alpha_us: float, bandwidth_gbs: float) -> list[dict[str, Any]]:
    alpha = alpha_us * 1e-6
    beta = 1.0 / (bandwidth_gbs * 1e9)
    rows = []
    for world in WORLD_SIZES:
        for channels in CHANNELS:
            ours, theirs = syncbn_traffic(world, channels), torch_traffic(world, channels)
            lat = latency_us(world, channels, alpha, beta)
            rows.append(
                {
                    "world_size": world,
                    "channels": channels,
                    "syncbn": ours,
                    "torch": theirs,
                    "sent_ratio_torch_over_syncbn": theirs["sent_bytes"] / ours["sent_bytes"],
                    **lat,
                    "best_syncbn_us": min(lat["syncbn_ring_us"], lat["syncbn_tree_us"]),
                }
            )
    return rows


def hierarchical_rows(
    channels: int, alpha_us: float, bandwidth_gbs: float, shm_round_us: float
) -> list[dict[str, Any]]:
    """Per layer-step: one machine's link bytes and predicted time, flat vs torch vs hierarchical."""
    alpha, beta, shm = alpha_us * 1e-6, 1.0 / (bandwidth_gbs * 1e9), shm_round_us * 1e-6
    sizes = (8 * (2 * channels + 1), 8 * 2 * channels)  # syncbn's two float64 vectors
    t_fwd, t_bwd = 4 * (2 * channels + 1), 4 * 2 * channels  # torch's float32 ones
    rows = []
    for machines in MACHINES:
        for per in RANKS_PER_MACHINE:
            world = machines * per
            flat_bytes = sum(2 * (world - 1) / world * s for s in sizes)
            torch_bytes = (world - 1) * t_fwd + 2 * (world - 1) / world * t_bwd
            hier_bytes = sum(2 * (machines - 1) / machines * s for s in sizes)
            flat_s = sum(ring_all_reduce_s(s, world, alpha, beta) for s in sizes)
            torch_s = ring_all_gather_s(t_fwd, world, alpha, beta) + ring_all_reduce_s(
                t_bwd, world, alpha, beta
            )
            hier_s = sum(2 * shm + ring_all_reduce_s(s, machines, alpha, beta) for s in sizes)
            rows.append(
                {
                    "machines": machines,
                    "ranks_per_machine": per,
                    "world_size": world,
                    "channels": channels,
                    "link_bytes": {"flat": flat_bytes, "torch": torch_bytes, "hierarchical": hier_bytes},
                    "time_us": {"flat": 1e6 * flat_s, "torch": 1e6 * torch_s, "hierarchical": 1e6 * hier_s},
                }
            )
    return rows


def format_hierarchical(
    rows: list[dict[str, Any]], alpha_us: float, bandwidth_gbs: float, shm_us: float
) -> str:
    out = [
        f"CPU groups of M machines x R ranks on gloo, C = {rows[0]['channels']}, per layer-step:"
        f" bytes on one machine's link (KiB) and predicted time (us; alpha = {alpha_us:g} us/hop,"
        f" {bandwidth_gbs:g} GB/s, one shared-memory round {shm_us:g} us; model, not measurement)",
        "",
        "| M | R | W | link: flat | link: torch | link: hier | time: flat | time: torch | time: hier"
        " | flat / hier | torch / hier |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, t = r["link_bytes"], r["time_us"]
        out.append(
            f"| {r['machines']} | {r['ranks_per_machine']} | {r['world_size']} | {_kib(b['flat'])} |"
            f" {_kib(b['torch'])} | {_kib(b['hierarchical'])} | {t['flat']:.0f} | {t['torch']:.0f} |"
            f" {t['hierarchical']:.0f} | {t['flat'] / t['hierarchical']:.1f} |"
            f" {t['torch'] / t['hierarchical']:.1f} |"
        )
    return "\n".join(out)


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def format_markdown(rows: list[dict[str, Any]], alpha_us: float, bandwidth_gbs: float) -> str:
    out = [
        "Bytes one rank sends (= receives) per layer-step, KiB (ring algorithms); 2 collectives each",
        "",
        "| W | C | syncbn sent | syncbn result held | torch sent | torch result held | torch/syncbn sent |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['world_size']} | {r['channels']} | {_kib(r['syncbn']['sent_bytes'])} |"
            f" {_kib(r['syncbn']['result_bytes_held'])} | {_kib(r['torch']['sent_bytes'])} |"
            f" {_kib(r['torch']['result_bytes_held'])} | {r['sent_ratio_torch_over_syncbn']:.2f} |"
        )
    out += [
        "",
        f"Predicted communication time per layer-step, us (alpha = {alpha_us:g} us/hop,"
        f" {bandwidth_gbs:g} GB/s per rank; model, not measurement)",
        "",
        "| W | C | syncbn ring | syncbn tree | torch (ring all_gather + best all_reduce) | torch / syncbn |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['world_size']} | {r['channels']} | {r['syncbn_ring_us']:.1f} | {r['syncbn_tree_us']:.1f} |"
            f" {r['torch_us']:.1f} | {r['torch_us'] / r['best_syncbn_us']:.2f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alpha-us", type=float, default=10.0, help="per-hop latency, us (default 10)")
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="per-rank GB/s (default 25)")
    parser.add_argument("--gloo-alpha-us", type=float, default=50.0, help="gloo per-hop latency, us (50)")
    parser.add_argument(
        "--gloo-bandwidth-gbs", type=float, default=1.25, help="gloo link GB/s (1.25: 10 GbE)"
    )
    parser.add_argument("--shm-round-us", type=float, default=20.0, help="one shared-memory round, us (20)")
    parser.add_argument("--channels", type=int, default=256, help="C of the hierarchical table (256)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = table(args.alpha_us, args.bandwidth_gbs)
    print(format_markdown(rows, args.alpha_us, args.bandwidth_gbs))
    hier = hierarchical_rows(args.channels, args.gloo_alpha_us, args.gloo_bandwidth_gbs, args.shm_round_us)
    print()
    print(format_hierarchical(hier, args.gloo_alpha_us, args.gloo_bandwidth_gbs, args.shm_round_us))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "alpha_us": args.alpha_us,
                    "bandwidth_gbs": args.bandwidth_gbs,
                    "rows": rows,
                    "hierarchical": {
                        "gloo_alpha_us": args.gloo_alpha_us,
                        "gloo_bandwidth_gbs": args.gloo_bandwidth_gbs,
                        "shm_round_us": args.shm_round_us,
                        "rows": hier,
                    },
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
