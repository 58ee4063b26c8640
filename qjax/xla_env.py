"""XLA:CPU flags qjax relies on. They are read once, when JAX starts its CPU backend, so they only take effect when
set before the first computation (importing qjax before anything runs a JAX op is enough).

- ``--xla_cpu_experimental_ynn_fusion_type=`` (empty: no YNNPACK fusions). With 1024 or more rows, XLA:CPU (jax
  0.10–0.11) fuses a quantized layer's dequantize + matmul + what follows into one YNNPACK fusion that is off by
  ~1e-2 absolute in float32 (op by op the same code is within 3e-6 of float64). Seen on the quantized
  ``in_proj_z`` → gated RMSNorm path at 4 × 257 tokens; dense models were unaffected.
- ``--xla_cpu_multi_thread_eigen=false`` (CLI, tests, benchmarks only: a speed choice, not a correctness one).
  Multi-threaded Eigen was no faster for these model sizes on 2 cores (AutoRound on the built-in model: 123 s vs
  97 s) and its pool was once seen wedged on this machine.

A flag the user already put in ``XLA_FLAGS`` is left as the user set it.
"""

from __future__ import annotations

import os

CORRECTNESS_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SPEED_FLAGS = {"xla_cpu_multi_thread_eigen": "false"}


def apply(*, single_threaded: bool = False, environ=os.environ) -> str:
    """Add qjax's XLA:CPU flags to ``environ["XLA_FLAGS"]`` (those the user has not set); returns the new value."""
    flags = dict(CORRECTNESS_FLAGS, **(SPEED_FLAGS if single_threaded else {}))
    cur = environ.get("XLA_FLAGS", "")
    add = [f"--{k}={v}" for k, v in flags.items() if k not in cur]
    if add:
        environ["XLA_FLAGS"] = " ".join([cur, *add]).strip()
    return environ.get("XLA_FLAGS", "")
