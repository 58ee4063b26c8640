#!/usr/bin/env bash
# One call on the lent H200: GPU correctness (Pallas vs reference) and all kernel timings, one table, < 8 minutes.
# The GPU image cannot install packages, so qjax is made importable from the working tree through a symlinked
# package folder (kernels/ -> qjax.kernels, convert/ -> qjax.convert), exactly as pyproject maps them.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PKG=$(mktemp -d)
mkdir -p "$PKG/qjax"
for f in "$ROOT"/qjax/*; do ln -s "$f" "$PKG/qjax/$(basename "$f")"; done
ln -s "$ROOT/kernels" "$PKG/qjax/kernels"
ln -s "$ROOT/convert" "$PKG/qjax/convert"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt" || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
# correctness first (fails the run on a mismatch), then the timings, all in one table
timeout 450 python3 benchmarks/kernels.py --check --repeats ${REPEATS:-20} "$@" 2>&1 | tee "$OUT/kernels.txt"
