"""All CPU benchmarks in one command; JSON and text land in ``benchmarks/results/``.

    python benchmarks/run.py            # full run (about 5-10 minutes on 2 cores)
    python benchmarks/run.py --quick    # small settings, a smoke test

1. per-layer timing on 2 gloo ranks: ``benchmarks/speed/layers.py`` (``syncbn bench``'s layer table
   with the developers' methods);
2. memory per layer (``benchmarks/memory/memory.py``);
3. end-to-end ResNet-style training step on 2 ranks (``benchmarks/speed/e2e.py``);
4. traffic/latency table for W = 2..1024 (``benchmarks/speed/scaling.py``);
5. the floor under a Python synchronised layer, syncbn's own work and the ranks' lockstep
   (``benchmarks/speed/floor.py``).

The GPU checks are separate: ``bash benchmarks/gpu_check.sh`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The scripts live in folders by purpose; each folder is a plain directory of scripts.
sys.path[:0] = [os.path.join(HERE, "speed"), os.path.join(HERE, "memory")]

import e2e  # noqa: E402
import floor  # noqa: E402
import layers  # noqa: E402
import memory  # noqa: E402
import scaling  # noqa: E402


def _tee(path: str, fn: object, *args: object) -> int:
    """Run ``fn(*args)``, print its output and save it to ``path``."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = fn(*args)  # type: ignore[operator]
    text = buf.getvalue()
    print(text, end="")
    with open(path, "w") as fh:
        fh.write(text)
    return int(code or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small settings (smoke test)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: layers,memory,e2e,scaling,floor"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    out = args.out
    code = 0
    if "layers" not in skip:
        layer_args = ["--json", os.path.join(out, "layers.json")]
        if args.quick:
            layer_args += ["--shapes", "4x8x6x6,64x16", "--iters", "5", "--warmup", "1"]
        code |= layers.main(layer_args)
    if "memory" not in skip:
        shapes = ["--shapes", "4x8x6x6,64x16"] if args.quick else []
        code |= _tee(
            os.path.join(out, "memory.txt"),
            memory.main,
            shapes + ["--json", os.path.join(out, "memory.json")],
        )
    if "e2e" not in skip:
        e2e_args = ["--fused-bound", "--json", os.path.join(out, "e2e.json")]
        if args.quick:
            e2e_args += ["--batch", "2", "--steps", "2", "--warmup", "1"]
        code |= e2e.main(e2e_args)
    if "scaling" not in skip:
        code |= _tee(
            os.path.join(out, "scaling.md"), scaling.main, ["--json", os.path.join(out, "scaling.json")]
        )
    if "floor" not in skip:
        floor_args = ["--json", os.path.join(out, "floor.json")]
        if args.quick:
            floor_args += ["--shapes", "64x16", "--steps", "3", "--blocks", "1"]
        code |= floor.main(floor_args)
    return code


if __name__ == "__main__":
    sys.exit(main())
