#!/usr/bin/env bash
# The lent H200's checks, one call per phase (each fits the 10-minute call limit):
#   benchmarks/gpu/run.sh kernels   GPU correctness (Pallas vs reference) and all kernel timings, one table, < 8 min
#   benchmarks/gpu/run.sh e2e       full-size Qwen3.6-35B-A3B, random weights: prefill/decode/TTFT/memory per
#                                   recipe + per-op profile of batch-1 decode, one table, < 8 min (issue 8)
#   benchmarks/gpu/run.sh serve     the serving engine at full size (random weights, w2w4): tokens/s, TTFT and ITL
#                                   at concurrency 1, 8, 32 vs sequential qjax.generate, one table, < 8 min (issue 17)
#   benchmarks/gpu/run.sh spec      MTP speculation at full size (random weights, w2w4, bf16): one verify call of
#                                   k + 1 = 2 … 5 tokens vs one decode step, batch 1, 512-token cache, < 5 min (issue 22)
#   benchmarks/gpu/run.sh vision    the full-size vision tower (random weights, bf16): one 448² image, one 1024² image
#                                   and a batch of four 448² images, median time and compile time, < 5 min (issue 23)
#   benchmarks/gpu/run.sh           all five (only when the session has the device time for them)
#   benchmarks/gpu/run.sh sweep     the GEMV block-size sweep (benchmarks/gpu/sweep_gemv.py), timed inside the device
#   benchmarks/gpu/run.sh budget    what fits one call of a 15-minute lease (< 9 min): the kernel rows behind the
#                                   targets (MoE, the 8192×2048 dense GEMV/GEMM, the GDN step), the vision tower, and
#                                   e2e w2w4 without the baseline; each part runs even if one before it fails
#   benchmarks/gpu/run.sh decode    GPU decode (one call, < 9 min; each part runs even if one before it fails):
#                                   kernel correctness (Pallas vs reference, no timings), the decode programs' XLA
#                                   modes A/B'd in one process (qjax/runtime/xla_options.py: wall time per step, no
#                                   profiler, tokens checked, the device's thunk structure and target config:
#                                   benchmarks/gpu/decode_graphs.py), then full-size decode B=1/8/64 and prefill of
#                                   w2w4 and w8a16-g32 in the fastest mode, then the MTP round (verify of k + 1
#                                   tokens vs one step); kernel rows with device-side time (profiler) in
#                                   $OUT/kernels_device.txt; $OUT/decode.md names the chip in every row
#   benchmarks/gpu/run.sh decode --dry-run   the plan and the imports, no GPU needed
#   benchmarks/gpu/run.sh autoround AutoRound at the real shapes (issue 49): one GDN and one attention block, random
#                                   weights made on the device, seed 000's recipe (W2 g64 experts, W4 g128 rest,
#                                   batch 8 × 2048), alg_ext on and off: s/iteration, peak device memory, the projected
#                                   whole seed-000 run (40 blocks × 1000 iterations), < 9 min
# Knobs (environment): REPEATS, KERNEL_ARGS (extra benchmarks/kernels.py flags), KERNEL_TIMEOUT, RECIPES, BASELINE
# ('' for none), RECIPE_TIMEOUT, E2E_TIMEOUT, VISION_REPEATS, VISION_TIMEOUT; decode: DECODE_MODES, DECODE_RECIPES,
# GRAPHS_TIMEOUT, DECODE_E2E_TIMEOUT, DECODE_KERNEL_TIMEOUT, DECODE_DEVTIME_TIMEOUT, DECODE_DEVTIME_FILTER,
# DECODE_SPEC_TIMEOUT; autoround: AUTOROUND_TIMEOUT, AUTOROUND_ARGS.
# Results land in $OUT (kernels.txt, e2e.md, e2e.json, vision.md); copy the tables into benchmarks/RESULTS.md.
# The GPU image cannot install packages, so qjax is made importable from the working tree through a symlinked
# package folder (kernels/ -> qjax.kernels, convert/ -> qjax.convert), exactly as pyproject maps them.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PHASE=${1:-all}
case "$PHASE" in
  kernels|e2e|serve|spec|vision|sweep|all|decode|autoround) ;;
  budget)
    self="$0"; rc=0
    REPEATS=10 KERNEL_TIMEOUT=120 KERNEL_ARGS="--skip-dense --skip-gdn" "$self" kernels || rc=1
    REPEATS=10 KERNEL_TIMEOUT=80 KERNEL_ARGS="--filter 8192x2048 --skip-moe --skip-gdn" "$self" kernels || rc=1
    REPEATS=10 KERNEL_TIMEOUT=45 KERNEL_ARGS="--skip-dense --skip-moe" "$self" kernels || rc=1
    VISION_REPEATS=5 VISION_TIMEOUT=100 "$self" vision || rc=1
    RECIPES=w2w4 BASELINE= RECIPE_TIMEOUT=170 E2E_TIMEOUT=180 "$self" e2e || rc=1
    exit $rc;;
  *) echo "usage: $0 [kernels|e2e|serve|spec|vision|sweep|all|budget|autoround|decode [--dry-run]]" >&2; exit 2;;
esac
PKG=$(mktemp -d)
mkdir -p "$PKG/qjax"
for f in "$ROOT"/qjax/*; do ln -s "$f" "$PKG/qjax/$(basename "$f")"; done
ln -s "$ROOT/kernels" "$PKG/qjax/kernels"
ln -s "$ROOT/convert" "$PKG/qjax/convert"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"
# the BF16 model is 65 GiB: leave XLA's allocator most of the 141 GB
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
if [[ $PHASE == decode && ${2:-} == --dry-run ]]; then
  # no GPU needed: the plan, the imports, and the commands below
  python3 benchmarks/gpu/decode_graphs.py --dry-run --out "$OUT" --modes "${DECODE_MODES:-xla,off,graphs,unrolled}" \
    --recipes "${DECODE_RECIPES:-w2w4}"
  echo "then: benchmarks/kernels.py --check --repeats 1; benchmarks/e2e.py --full --recipes w2w4,w8a16-g32 in \$OUT/best_mode.txt's mode"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt" || true
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
if [[ $PHASE == kernels || $PHASE == all ]]; then
  # correctness first (fails the run on a mismatch), then the timings, all in one table
  # KERNEL_ARGS narrows the run (e.g. "--skip-dense --skip-gdn" or "--filter 8192x2048"); appended to kernels.txt
  # so that several narrowed runs in one call keep every table
  timeout ${KERNEL_TIMEOUT:-450} python3 benchmarks/kernels.py --check --repeats ${REPEATS:-20} ${KERNEL_ARGS:-} 2>&1 \
    | tee -a "$OUT/kernels.txt"
fi
if [[ $PHASE == e2e || $PHASE == all ]]; then
  # one process per recipe (its own peak memory); e2e.md is rewritten after each recipe, so a run cut short by the
  # timeout still leaves the recipes it finished. Baseline (plain-XLA dequantize-then-matmul) for w2w4 only: it
  # doubles the compiles.
  timeout ${E2E_TIMEOUT:-460} python3 benchmarks/e2e.py --full --no-write --out "$OUT" --timeout ${RECIPE_TIMEOUT:-200} --baseline "${BASELINE-w2w4}" \
    --recipes ${RECIPES:-w2w4,w8a16-g32,mxfp8-experts,bf16} 2>&1 | tee "$OUT/e2e.txt" || true
  test -s "$OUT/e2e.md"
fi
if [[ $PHASE == serve || $PHASE == all ]]; then
  timeout 460 python3 benchmarks/serve.py --model full --recipe w2w4 --dtype bfloat16 --prompt 512 --output 128 \
    --concurrency 1,8,32 --repeats 3 --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.txt"
fi
if [[ $PHASE == spec || $PHASE == all ]]; then
  timeout 300 python3 benchmarks/speculative.py --cost-only --full --recipe w2w4 --dtype bfloat16 --no-write \
    --repeats 5 2>&1 | tee "$OUT/spec.txt"
fi
if [[ $PHASE == sweep ]]; then
  # the fastest config per scheme into $OUT/tiles.json (starting from the committed table): copy it over
  # kernels/tiles.json with the RESULTS rows; choose_config reads it on that chip
  cp kernels/tiles.json "$OUT/tiles.json"
  timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/gpu/sweep_gemv.py --table-out "$OUT/tiles.json" ${SWEEP_ARGS:-} \
    2>&1 | tee "$OUT/sweep.txt"
fi
if [[ $PHASE == vision || $PHASE == all ]]; then
  # qjax only (the image has no torch/transformers, maybe no Pillow: pixel values come from numpy); writes vision.md
  timeout ${VISION_TIMEOUT:-300} python3 benchmarks/vision.py --gpu --repeats ${VISION_REPEATS:-10} --out "$OUT" 2>&1
fi
if [[ $PHASE == autoround ]]; then
  # each setting (alg_ext on, off) in its own child process, so each peak is its own; the table names the chip
  timeout ${AUTOROUND_TIMEOUT:-520} python3 benchmarks/autoround_blocks_gpu.py ${AUTOROUND_ARGS:---iters 20 --nsamples 32} \
    2>&1 | tee "$OUT/autoround.txt"
fi
if [[ $PHASE == decode ]]; then
  rc=0
  # 1. GPU correctness of every kernel (Pallas vs reference; fails on a mismatch), one timed call each (< 1.5 min),
  #    then the target rows with the device's own time per call (profiler kernel durations: the W4G128 8192×2048
  #    GEMV's share of the copy bandwidth at M = 1, the MoE layer at one token) (< 1 min)
  timeout ${DECODE_KERNEL_TIMEOUT:-85} python3 benchmarks/kernels.py --check --repeats 1 ${KERNEL_ARGS:-} 2>&1 \
    | tee -a "$OUT/kernels.txt" || rc=1
  timeout ${DECODE_DEVTIME_TIMEOUT:-60} python3 benchmarks/kernels.py --device-time --repeats 10 --skip-gdn \
    --filter "${DECODE_DEVTIME_FILTER:-dense int4_g128 8192x2048,moe int2_g64}" 2>&1 | tee "$OUT/kernels_device.txt" || rc=1
  # 2. the decode programs' XLA modes, interleaved in one process, w2w4 batch 1 (< 2.5 min): $OUT/best_mode.txt
  timeout ${GRAPHS_TIMEOUT:-140} python3 benchmarks/gpu/decode_graphs.py --out "$OUT" \
    --modes "${DECODE_MODES:-xla,off,graphs,unrolled}" --recipes "${DECODE_RECIPES:-w2w4}" 2>&1 \
    | tee "$OUT/decode_graphs.txt" || rc=1
  # 3. full size, w2w4 and w8a16-g32: prefill 1×2048 and 8×512, decode B=1/8/64, in the fastest mode (< 3.5 min)
  mode=$(cat "$OUT/best_mode.txt" 2>/dev/null || echo xla)
  QJAX_DECODE_GRAPHS=$mode timeout ${DECODE_E2E_TIMEOUT:-210} python3 benchmarks/e2e.py --full --no-write --out "$OUT" \
    --timeout 120 --baseline '' --recipes w2w4,w8a16-g32 -- --repeats 3 2>&1 | tee "$OUT/e2e.txt" || rc=1
  # 4. the MTP round at full size, w2w4, 512-token cache: verify of k + 1 tokens vs one decode step (k = 1 … 4), the
  #    speed it projects at the built-in model's acceptance (RESULTS.md "MTP speculation") (< 1 min)
  QJAX_DECODE_GRAPHS=$mode timeout ${DECODE_SPEC_TIMEOUT:-60} python3 benchmarks/speculative.py --cost-only --full \
    --recipe w2w4 --dtype bfloat16 --no-write --repeats 3 2>&1 | tee "$OUT/spec.txt" || rc=1
  python3 benchmarks/gpu/decode_graphs.py --table "$OUT" > /dev/null || rc=1
  echo "decode phase: mode $mode for e2e; tables in $OUT/decode.md"
  exit $rc
fi
