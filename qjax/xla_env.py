"""XLA:CPU flags qjax relies on. They are read once, when JAX starts its CPU backend, so they only take effect when
set before the first computation (importing qjax before anything runs a JAX op is enough).

- ``--xla_cpu_experimental_ynn_fusion_type=individual_dot``: YNNPACK runs single dots, and no YNNPACK fusions are
  formed. The fusions are off for correctness: with 1024 or more rows, XLA:CPU (jax 0.10–0.11) fused a quantized
  layer's dequantize + matmul + what follows into one YNNPACK fusion that was off by ~1e-2 absolute in float32 (op by
  op the same code is within 3e-6 of float64; seen on the quantized ``in_proj_z`` → gated RMSNorm path at 4 × 257
  tokens). The single dots are on for speed: XLA:CPU's own small matmuls are 2–2.5× slower (a [64, 512] × [512, 512]
  float32 product 0.66 ms against numpy's 0.21 ms) and the ``mid`` prefill was 1.35× (float32) to 2× (bfloat16)
  faster with them (RESULTS.md, CPU prefill); float32 results stay as close to float64 as before.
  One condition: every bfloat16 dot must be one YNNPACK takes. XLA's own dot thunk cannot run bf16 × bf16 → f32, and
  with this flag XLA no longer rewrites such a dot for it, so a dot YNNPACK declines fails at run time
  (``UNIMPLEMENTED: Unsupported element type for DotThunk::Execute``). The one seen was attention's
  probabilities × values with a transposed result layout (batch > 1, multi-threaded Eigen only); qjax writes that
  product batch-major (``qjax.model.qwen3_5_moe.attention``). tests/test_xla_env.py runs bf16 prefill, decode and
  MTP rounds at batch 3 with the library's flags in a child process; the compressed-tensors recipes, the vision tower
  and AutoRound were checked the same way by hand (2026-12-04).
- ``--xla_cpu_multi_thread_eigen=false`` (CLI, tests, benchmarks only: a speed choice, not a correctness one).
  Multi-threaded Eigen was no faster for these model sizes on 2 cores (AutoRound on the built-in model: 123 s vs
  97 s) and its pool was once seen wedged on this machine.

A flag the user already put in ``XLA_FLAGS`` is left as the user set it.

Where the persistent compilation cache lives (:func:`compile_cache_dir`) is decided here too; the commands that
compile the same programs run after run switch it on (``qjax quantize``: one tuning step per block structure, each
5–15 s to compile on CPU). It is process-wide JAX state, so only a command's entry point sets it, never the library
(and this module stays free of jax: it runs before anything else is imported).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

CORRECTNESS_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "individual_dot"}
SPEED_FLAGS = {"xla_cpu_multi_thread_eigen": "false"}


def apply(*, single_threaded: bool = False, environ=os.environ) -> str:
    """Add qjax's XLA:CPU flags to ``environ["XLA_FLAGS"]`` (those the user has not set); returns the new value."""
    flags = dict(CORRECTNESS_FLAGS, **(SPEED_FLAGS if single_threaded else {}))
    cur = environ.get("XLA_FLAGS", "")
    add = [f"--{k}={v}" for k, v in flags.items() if k not in cur]
    if add:
        environ["XLA_FLAGS"] = " ".join([cur, *add]).strip()
    return environ.get("XLA_FLAGS", "")


COMPILE_CACHE_ENV = "QJAX_COMPILE_CACHE"  # a folder, or "off"


def compile_cache_dir(flag: str | None = None, environ=os.environ) -> str | None:
    """Where compiled programs are kept between runs: ``flag`` (a command's ``--compile_cache``), else
    ``$QJAX_COMPILE_CACHE``, else JAX's own ``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/qjax/jax``
    (``~/.cache/qjax/jax``); None when it is ``off``."""
    value = flag if flag is not None else environ.get(COMPILE_CACHE_ENV, environ.get("JAX_COMPILATION_CACHE_DIR"))
    if value is None:
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        value = os.path.join(base, "qjax", "jax")
    return None if value.strip().lower() in ("off", "none", "") else os.path.abspath(os.path.expanduser(value))


@functools.cache
def malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: other allocators return memory their own way). XLA:CPU's smaller
    buffers and the readers' staging come from the C heap, whose freed pages glibc keeps for reuse; the server after
    a large request and the streamed quantize between blocks hand them back with ``malloc_trim()(0)``."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
