"""Bit-for-bit comparison of two syncbn source trees: sha256 of every result on fixed seeds.

Each tree runs, in fresh processes, the same training steps of ``syncbn.SyncBatchNorm`` on
inputs that take every forward path (native statistics: small, 2D, channels-last; two-pass;
blocked two-pass; 3D and 5D input; an odd batch), float64, float32 and bfloat16, with and
without affine parameters and running statistics:

* ``1proc``: one process; the module over a group whose sum is the identity (the layer's
  own arithmetic), and the autograd function over a forced one-member ``ProcessGroupSum``
  (a real framed sum through the shared memory of a one-rank gloo group);
* ``2gloo``: two gloo ranks (``FileStore``), each with its own seeded batch.

Per case it hashes the output, the input, weight and bias gradients, the running statistics
after three steps and an eval-mode output, and prints which cases differ::

    python benchmarks/precision/bit_identity.py --src OLD/src --src NEW/src

Exit status 1 when any hash differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

SHAPES = (
    "8x32x8x8",  # native statistics (small)
    "16x32x8x8",  # two-pass, scratch in the output buffer
    "64x128",  # 2D: native
    "256x512",
    "32x256x8x8",  # two-pass
    "12x32x10x10",  # two-pass, a count that is not a power of two
    "5x16x120x120",  # blocked two-pass, a count that is not a power of two
    "8x32x64x64",  # blocked two-pass (>= 2**20 values)
    "3x5x7x7",  # odd, small
    "4x8x4x8x8",  # 5D
    "8x16x8x8x8",  # 5D two-pass
    "cl16x32x8x8",  # channels-last
)
DTYPES = ("float64", "float32", "bfloat16", "float16")

_CHILD = r"""
import hashlib, json, os, sys, tempfile
import torch
torch.set_num_threads(1)
import torch.distributed as dist
import syncbn
from syncbn import groups
try:
    from syncbn.engine._function import SyncBatchNormFunction
except ImportError:  # a tree from before the engine had its folder
    from syncbn._function import SyncBatchNormFunction
try:  # the engine's parameter object: apply(x, weight, bias, Params(...))
    from syncbn.engine._function import Params
    def _apply(x, w, b, rm, rv, eps, momentum, group, layer):
        return SyncBatchNormFunction.apply(x, w, b, Params(rm, rv, eps, momentum, group, layer))
except ImportError:
    _apply = SyncBatchNormFunction.apply

from syncbn.cli._bench_methods import LoopbackGroup as Loopback  # a group of 2 whose sum is the identity

def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()

def make(spec, dtype, seed):
    cl = spec.startswith("cl")
    shape = [int(s) for s in spec.removeprefix("cl").split("x")]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1.5).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if cl:
        cl = torch.channels_last
        x, dy = x.contiguous(memory_format=cl), dy.contiguous(memory_format=cl)
    return shape, x, dy

def module_case(spec, dtype, rank, group, affine, track):
    shape, _, _ = make(spec, dtype, 0)
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    m = syncbn.SyncBatchNorm(
        shape[1], affine=affine, track_running_stats=track, process_group=group, dtype=pdtype
    )
    gen = torch.Generator().manual_seed(99)
    if affine:
        with torch.no_grad():
            m.weight.copy_(torch.rand(shape[1], generator=gen, dtype=torch.float64) + 0.5)
            m.bias.copy_(torch.randn(shape[1], generator=gen, dtype=torch.float64))
    got = []
    for step in range(3):
        _, x, dy = make(spec, dtype, 1000 * step + rank)
        x.requires_grad_(True)
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.backward(dy)
        got += [out, x.grad, m.weight.grad if affine else None, m.bias.grad if affine else None]
    got += [m.running_mean, m.running_var]
    m.eval()
    got.append(m(make(spec, dtype, 7)[1]))
    return digest(got)

def function_case(spec, dtype, group):
    shape, x, dy = make(spec, dtype, 5)
    c = shape[1]
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.linspace(0.5, 1.5, c, dtype=pdtype).requires_grad_(True)
    b = torch.linspace(-1, 1, c, dtype=pdtype).requires_grad_(True)
    rm, rv = torch.zeros(c, dtype=pdtype), torch.ones(c, dtype=pdtype)
    layer = syncbn.SyncBatchNorm(c)
    got = []
    for _ in range(2):
        xg = x.detach().requires_grad_(True)
        out = _apply(xg, w, b, rm, rv, 1e-5, 0.1, group, layer)
        out.backward(dy)
        got += [out, xg.grad, w.grad, b.grad]
        w.grad = b.grad = None
    return digest(got + [rm, rv])

def run(rank, mode, shapes, dtypes):
    res = {}
    for spec in shapes:
        for dn in dtypes:
            dtype = getattr(torch, dn)
            for affine, track in ((True, True), (False, False)):
                key = f"{mode} {spec} {dn} affine={affine} track={track}"
                group = Loopback() if mode == "1proc" else None
                res[key + " module"] = module_case(spec, dtype, rank, group, affine, track)
            if mode == "1proc":
                one = groups.ProcessGroupSum(None)
                res[f"{mode} {spec} {dn} function-1rank"] = function_case(spec, dtype, one)
    return res

mode, shapes, dtypes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
if mode == "1proc":
    path = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    print(json.dumps(run(0, mode, shapes, dtypes)))
    dist.destroy_process_group()
else:
    rank, world = int(os.environ["RANK"]), 2
    store = dist.FileStore(os.environ["STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out = run(rank, mode, shapes, dtypes)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({f"rank{rank} {k}": v for k, v in out.items()}))
"""


def _run_tree(src: str, shapes: str, dtypes: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _CHILD]
    args = [*cmd, "1proc", shapes, dtypes]
    one = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if one.returncode:
        raise SystemExit(f"{src} (1proc) failed:\n{one.stderr[-4000:]}")
    result: dict[str, str] = json.loads(one.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            subprocess.Popen(
                [*cmd, "2gloo", shapes, dtypes],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**env, "RANK": str(r), "STORE": store},
            )
            for r in range(2)
        ]
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode:
                raise SystemExit(f"{src} (2gloo) failed:\n{err[-4000:]}")
            result.update(json.loads(out.strip().splitlines()[-1]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", action="append", required=True, help="a src/ folder (give two)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    if len(args.src) != 2:
        parser.error("give --src twice: the reference tree, then the tree to check")
    ref, new = (_run_tree(os.path.abspath(s), args.shapes, args.dtypes) for s in args.src)
    differ = sorted(k for k in ref if ref[k] != new.get(k))
    combined = hashlib.sha256(json.dumps(sorted(new.items())).encode()).hexdigest()
    print(f"{len(ref)} cases, {len(differ)} differ; combined sha256 of the checked tree: {combined}")
    for key in differ:
        print(f"  DIFFERS: {key}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
