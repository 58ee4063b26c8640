"""qjax.xla_env: the XLA:CPU flags qjax adds, and where the persistent compilation cache lives."""

from __future__ import annotations

import os

import pytest
from oracles.hf import FLOAT32_PARITY_TOL

from qjax import xla_env


def test_flags_added_once_and_a_users_flag_wins():
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}
    got = xla_env.apply(single_threaded=True, environ=env)
    assert "--xla_cpu_multi_thread_eigen=true" in got and "multi_thread_eigen=false" not in got
    assert "--xla_cpu_experimental_ynn_fusion_type=individual_dot" in got
    assert xla_env.apply(single_threaded=True, environ=env) == got  # idempotent


@pytest.mark.parametrize("flag,environ,want", [
    (None, {}, os.path.join(os.path.expanduser("~"), ".cache", "qjax", "jax")),
    (None, {"XDG_CACHE_HOME": "/x"}, "/x/qjax/jax"),
    (None, {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/x"}, "/j"),
    (None, {"QJAX_COMPILE_CACHE": "/q", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/q"),
    ("/f", {"QJAX_COMPILE_CACHE": "/q"}, "/f"),
    ("off", {"QJAX_COMPILE_CACHE": "/q"}, None),
    (None, {"QJAX_COMPILE_CACHE": "OFF"}, None),
])
def test_compile_cache_dir_precedence(flag, environ, want):
    """The command's flag, then qjax's variable, then JAX's own, then the XDG cache folder; 'off' turns it off."""
    assert xla_env.compile_cache_dir(flag, environ=environ) == want


_BF16_PROBE = """
import numpy as np, jax.numpy as jnp, qjax
from oracles.hf import tiny_text_config
from qjax.model.config import TextConfig
cfg = TextConfig.from_dict(tiny_text_config(mtp_num_hidden_layers=1))
ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (3, 37)).astype(np.int32)
mask = np.ones_like(ids)
mask[1, :5] = 0  # a left-padded row
model = qjax.init_model(cfg, dtype=jnp.bfloat16, with_mtp=True)
logits, _ = qjax.extend(model, model.init_cache(3, 37), jnp.asarray(ids))
assert np.isfinite(np.asarray(logits, np.float32)).all()
assert np.isfinite(np.asarray(model(jnp.asarray(ids)), np.float32)).all()
for spec in (None, "mtp"):
    out = qjax.generate(model, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], speculative=spec)
    assert np.asarray(out).shape == (3, 41)
print("ok")
"""


@pytest.mark.subprocess
def test_bfloat16_model_runs_at_batch_above_one_under_ynnpack_dots():
    """With YNNPACK's single dots on, a bf16 × bf16 → f32 dot YNNPACK declines fails at run time (XLA's own dot thunk
    has no such kernel): attention's probabilities × values did, in ``qjax.extend`` at batch > 1, until written
    batch-major. Only with XLA:CPU's default multi-threaded Eigen (a library user's setting; the suite runs
    single-threaded, where XLA picked another path), so in a child process with qjax's library flags alone. Prefill,
    decode and MTP speculative rounds in bfloat16 at batch 3 (their values: the bf16 oracle tests)."""
    import subprocess
    import sys

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "multi_thread_eigen" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    assert xla_env.apply(environ=env).count("individual_dot") == 1
    run = subprocess.run([sys.executable, "-P", "-c", _BF16_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


_DEFAULT_FLAGS_PROBE = """
import sys, numpy as np, jax.numpy as jnp, qjax
model = qjax.load_model(sys.argv[1], dtype=jnp.float32)
ids = np.random.default_rng(4).integers(1, model.config.vocab_size, (2, 40)).astype(np.int32)
logits = np.asarray(model(jnp.asarray(ids)), np.float32)
tokens = np.asarray(qjax.generate(model, ids, max_new_tokens=6, eos_token_id=[], do_sample=False))
np.savez(sys.argv[2], ids=ids, logits=logits, tokens=tokens)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_library_flags_alone_compute_what_the_suite_checks(tiny_hf, tmp_path):
    """The suite compiles with faster-compiling XLA:CPU settings than a user gets (less LLVM optimisation, the legacy
    elemental emitters, which fuse a little less and expand scatters into loops). So once, in a child process with
    qjax's library flags alone, the tiny model's float32 logits are checked against transformers (the suite's
    tolerance, tests/test_model.py) and its greedy tokens against the same generate compiled the suite's way."""
    import subprocess
    import sys

    import jax.numpy as jnp
    import numpy as np
    import torch

    import qjax

    hf, folder = tiny_hf
    # no XLA_FLAGS at all: importing qjax adds the library's own (qjax.xla_env), as for a user
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    out = tmp_path / "probe.npz"
    run = subprocess.run([sys.executable, "-P", "-c", _DEFAULT_FLAGS_PROBE, folder, str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    with torch.no_grad():
        want = hf(torch.as_tensor(got["ids"], dtype=torch.long)).logits.numpy()
    assert np.abs(got["logits"] - want).max() <= FLOAT32_PARITY_TOL
    model = qjax.load_model(folder, dtype=jnp.float32)
    here = qjax.generate(model, got["ids"], max_new_tokens=6, eos_token_id=[], do_sample=False)
    np.testing.assert_array_equal(np.asarray(here), got["tokens"])
