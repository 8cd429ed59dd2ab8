"""CmBN on 2 and 3 gloo ranks: every family and path against the definition (see test_cmbn.py).

Uneven and empty per-rank micro-batches; one collective each way per layer and call, as without
CmBN (the block's one vote at its end included); the first micro-batch is plain synchronised batch
norm bit for bit; DDP with ``no_sync``; torch.compile without recompilation per micro-batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import _helpers.compiling  # noqa: F401  (the compiler's modules, inherited by the forked ranks)
import syncbn
from _helpers.dist_harness import launch
from _helpers.marks import HAS_COMPILED_OPS
from syncbn import groups
from test_cmbn import FAMILIES, TOL, _after_through, _region, data, make_layer, run_block

pytestmark = pytest.mark.timeout(400)

# sizes[t][r]: uneven, an empty rank, a micro-batch of one sample in all
SIZES = {2: [[2, 3], [0, 2], [1, 0], [3, 1]], 3: [[2, 3, 1], [4, 0, 2], [1, 0, 0], [1, 1, 3]]}


def _counting() -> dict[str, int]:
    """Count this process's collectives (the layers' and the block's vote)."""
    calls = {"n": 0}
    for name in ("all_reduce_sum", "all_reduce_sum_bounded"):
        original = getattr(groups.ProcessGroupSum, name)

        def counting(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Tensor:
            calls["n"] += 1
            return _original(self, *args, **kwargs)

        setattr(groups.ProcessGroupSum, name, counting)
    return calls


def _ranks(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    calls = _counting()
    out: dict[str, Any] = {}
    shards = data(20 + world, SIZES[world])
    for family in FAMILIES:
        calls["n"] = 0
        out[f"{family} eager"] = run_block(family, shards, rank)
        pooled = calls["n"]
        calls["n"] = 0
        layer = make_layer(family)
        with syncbn.accumulation(layer):  # micro-batch normalisation: the same collectives
            for row in shards:
                layer(row[rank].clone().requires_grad_() * 1.0).sum().backward()
        out[f"{family} collectives"] = (pooled, calls["n"])
        out[f"{family} momentum=None"] = run_block(family, shards, rank, momentum=None)
        out[f"{family} checkpoint"] = run_block(family, shards, rank, call=lambda m, x: _region(m, x, False))

        # the first micro-batch is plain synchronised batch norm, bit for bit
        layer, plain = make_layer(family), make_layer(family)
        x = shards[0][rank]
        with syncbn.accumulation(layer, normalize="cumulative"):
            y = layer(x * 1.0)
        out[f"{family} first"] = torch.equal(y, plain(x * 1.0))

        # DDP, no_sync for all but the last micro-batch (no empty rank: DDP needs a graph)
        full = data(30 + world, [[2] * world, [1] * world, [3] * world])
        steps = {"t": 0}

        def ddp_call(model: Any, x: Tensor, steps: dict[str, int] = steps, k: int = len(full)) -> Tensor:
            steps["t"] += 1
            if steps["t"] < k:
                with model.no_sync():
                    return model(x)  # type: ignore[no-any-return]
            return model(x)  # type: ignore[no-any-return]

        def wrap(layer: nn.Module) -> nn.Module:
            return nn.parallel.DistributedDataParallel(_after_through(layer))

        out[f"{family} ddp"] = run_block(family, full, rank, call=ddp_call, module=wrap, averaged=world)

        if compiled:  # one frame, none per micro-batch
            counter = CompileCounterWithBackend("aot_eager")
            runs: dict[int, Any] = {}

            def compiled_call(
                model: nn.Module, x: Tensor, runs: Any = runs, counter: Any = counter
            ) -> Tensor:
                run = runs.setdefault(id(model), torch.compile(model, backend=counter, fullgraph=True))
                return run(x)  # type: ignore[no-any-return]

            even = data(40 + world, [[2] * world] * 3)
            out[f"{family} compiled"] = run_block(
                family, even, rank, call=compiled_call, module=_after_through
            )
            out[f"{family} frames"] = counter.frame_count
    # an exception on rank 0 only: every rank puts its statistics back (the block's vote)
    layer = make_layer("renorm")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    try:
        with syncbn.accumulation(layer, normalize="cumulative"):
            for row in shards[:2]:
                layer(row[rank] * 1.0)
            if rank == 0:
                raise KeyError("stop")
    except KeyError:
        pass
    changed = max((v - before[k]).abs().max().item() for k, v in layer.state_dict().items())
    out["exception unchanged"] = changed == 0.0 and "_syncbn_cmbn" not in layer.__dict__
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_the_definition(world: int) -> None:
    compiled = HAS_COMPILED_OPS and world == 2
    results = launch(_ranks, world, compiled, timeout=380)
    for rank, result in enumerate(results):
        for case, value in result.items():
            if case.endswith("collectives"):
                assert value[0] == value[1], (rank, case, value)
            elif case.endswith(("first", "unchanged")):
                assert value is True, (rank, case)
            elif case.endswith("frames"):
                assert value == 1, (rank, case, value)
            else:
                assert max(value.values()) < TOL, (rank, case, value)
