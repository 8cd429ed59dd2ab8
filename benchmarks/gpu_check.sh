#!/usr/bin/env bash
# GPU checks and benchmark for syncbn, about 5 minutes on one CUDA GPU. From the repository root:
#
#     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
#
# (a Python whose torch has CUDA, with syncbn installed: pip install -e ".[dev]").
# Writes benchmarks/results/gpu_*.{txt,json}; copy the tables into benchmarks/RESULTS.md.
# Exit code: 0 when the checks pass (the benchmark numbers are recorded, never asserted).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
status=0

"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "no CUDA device visible"; exit 2; }
nvidia-smi -L 2>/dev/null | tee "$OUT/gpu_machine.txt"

echo "== 1. CUDA checks: exactness (2 gloo ranks on one GPU), no host sync, CUDA graph capture"
timeout 180 "$PY" benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.txt" || status=1

echo "== 2. bench: 2 ranks sharing the GPU through gloo, syncbn vs torch.nn.SyncBatchNorm"
SHAPES=64x64x64x64,128x256x16x16,4096x512,16x32x16x32x32,64x128x56x56
timeout 240 "$PY" -m syncbn bench --device cuda --world-size 2 --backend gloo --shapes "$SHAPES" \
    --iters 30 --warmup 5 --json "$OUT/gpu_bench_w2_gloo.json" 2>&1 | tee "$OUT/gpu_bench_w2_gloo.txt"

echo "== 3. per layer: 1 rank with the synchronised paths forced (NCCL group of one), benchmarks/speed/layers.py"
timeout 180 "$PY" benchmarks/speed/layers.py --device cuda --world-size 1 --force-sync --backend nccl --shapes "$SHAPES" \
    --iters 50 --warmup 5 --json "$OUT/gpu_bench_w1_forced.json" 2>&1 | tee "$OUT/gpu_bench_w1_forced.txt"

exit $status
