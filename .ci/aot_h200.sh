#!/usr/bin/env bash
# Deviceless AOT compile of every Pallas kernel variant for an H200 (docs/kernels.md §6 "Level B"; no GPU needed).
# Shared-memory / resource errors that would only surface on the H200 fail here.
#
# Env: .venv-aot (Python 3.12) with the GPU image's stack, jax == jaxlib == jax-cuda13-plugin == jax-cuda13-pjrt
# == 0.11.2 (no nvidia-* wheels), plus this repo (editable) and its declared dependencies, because
# `import qjax.kernels` runs qjax/__init__ (flax).  Re-created only when the pins, pyproject.toml, the Python or the
# checkout path change (stamp file), so a warm run skips pip entirely.
#
# Then: python -m qjax.kernels.aot_h200 --self-test   (a good tiling must compile, an oversized one must fail
#       with RESOURCE_EXHAUSTED shared memory: proves the check can fail), every case of every kernel module, and
#       the decode gate (benchmarks/e2e_aot.py --gate): the full-size w2w4 decode loop compiled for the H100 and the
#       H200, failing when launches per step, idle Pallas programs, host round trips per layer / per step or host ops
#       per step rise above the one table of limits in that script (today's values: a ratchet), with the distance to
#       the issue's target (≤ 400 launches, 0 idle, 0 round trips, one graph per step) printed on every run.
# Exit status: non-zero on any failure.  Knobs: AOT_H200_PYTHON (a python3.12), AOT_H200_JOBS (compile threads).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-aot
REQS=(jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
      flatbuffers numpy ml_dtypes flax==0.12.12)
t_start=$SECONDS

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_py312() {
    local c
    for c in "${AOT_H200_PYTHON:-}" "$(command -v python3.12 || true)" \
             "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if is_py312 "$c"; then echo "$c"; return 0; fi
    done
    echo "aot_h200: no Python 3.12 found (set AOT_H200_PYTHON); jax 0.11 needs Python >= 3.12" >&2
    return 1
}

if ! is_py312 "$VENV/bin/python"; then
    py=$(find_py312)
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"   # keep the 1.2 GB env out of git (and out of anything that copies the tree)
fi

stamp="$VENV/.aot-h200-stamp"
want=$(printf '%s\n' "${REQS[*]} -e ." "$(sha256sum pyproject.toml)" "$PWD" "$("$VENV/bin/python" --version)")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$stamp"
    # (grep drops the harmless "Location 'file://…' is ignored" lines of this machine's pip config)
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${REQS[@]}" -e . 2>&1 \
            | { grep -v "^WARNING: Location 'file://" || true; }; then
        echo "aot_h200: pip install failed" >&2; exit 1
    fi
    "$VENV/bin/python" -c 'import jax, jaxlib; assert jax.__version__ == jaxlib.__version__ == "0.11.2"'
    printf '%s\n' "$want" > "$stamp"
fi
t_install=$((SECONDS - t_start))

export JAX_PLATFORMS=cpu   # no GPU here: keeps the CUDA plugin from probing; deviceless compile still works
"$VENV/bin/python" -m qjax.kernels.aot_h200 --self-test
"$VENV/bin/python" -m qjax.kernels.aot_h200 --jobs "${AOT_H200_JOBS:-1}"
t_gate=$SECONDS
"$VENV/bin/python" benchmarks/e2e_aot.py --gate --targets h200,h100
echo "aot_h200: decode gate $((SECONDS - t_gate))s"
echo "aot_h200: OK (env ${t_install}s, total $((SECONDS - t_start))s)"
