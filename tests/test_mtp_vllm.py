"""The MTP head against vLLM's ``Qwen3_5MoeMTP`` (tests/oracles/vllm_mtp.py: a float64 numpy transcription of vLLM's
forward, fed vLLM's own inputs — ids shifted by one, the main model's post-final-norm hidden, target positions), for
the fused (Qwen3.6) and per-expert (Qwen3.5) ``mtp.*`` expert layouts: ``mtp_logits``, and the cached ``mtp_forward``
over a prompt in two chunks plus one chained draft step.

Tolerances, relative to max |logit| (measured on the tiny config, B = 2, T = 19, both layouts):
- float32 qjax vs the float64 oracle fed the same float32 hidden states: ≤ 5.1e-7 (logits of every path and the
  head's output hidden); bound F32_REL = 1e-5, the issue's.
- float64 qjax: ≤ 8.4e-16; bound F64_REL = 1e-12.
A wrong convention (fc concat order, dropped shared expert, gate/up halves swapped, ``w`` for ``1 + w``, the
pre-final-norm hidden) moves the logits by 0.16–1.9 of their scale (``test_oracle_tells_the_conventions_apart``).
"""

from __future__ import annotations

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import vllm_mtp
from oracles.hf import write_official_layout
from safetensors.numpy import load_file

import qjax

F32_REL = 1e-5  # float32 qjax vs the float64 oracle, relative to max |logit| (the bound; measured ≤ 5.1e-7)
F64_REL = 1e-12  # float64 qjax vs the oracle (measured ≤ 8.4e-16)
WRONG = 1e-2  # a wrong convention in the oracle must move the logits by more than this (relative): ≥ 1000× F32_REL
B, T = 2, 19


def _rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=["fused", "per_expert"])
def ckpt(request, tiny_hf, tmp_path_factory):
    """(folder, numpy weights by on-disk name, config.json) of tiny_hf in the official layout, ``mtp.*`` experts
    fused (Qwen3.6) or per expert (Qwen3.5)."""
    fused = request.param == "fused"
    folder = write_official_layout(tiny_hf[1], tmp_path_factory.mktemp(f"mtp-{request.param}"), mtp_fused=fused,
                                   with_visual=False)
    weights = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        weights.update(load_file(f))
    stem = "mtp.layers.0.mlp.experts."
    assert (stem + "gate_up_proj" in weights) == fused and (stem + "0.gate_proj.weight" in weights) != fused
    with open(os.path.join(folder, "config.json")) as f:
        return folder, weights, json.load(f)


@functools.partial(jax.jit, static_argnums=0)
def _main(graphdef, state, ids):
    """The main model's post-final-norm hidden (what vLLM hands the head) and the last layer's output before it."""
    out = nnx.merge(graphdef, state).forward(ids, output_hidden_states=True)
    return out.hidden, out.hidden_states[-1]


@pytest.fixture(scope="module")
def main(ckpt):
    """(ids ``[B, T]``, the float32 main model's post-final-norm hidden ``[B, T, H]`` and its last layer's output
    before that norm), numpy: the head's inputs for every test here (one main-model compile for the module)."""
    model = qjax.load_model(ckpt[0], dtype="float32")
    ids = np.random.default_rng(11).integers(0, model.config.vocab_size, (B, T)).astype(np.int32)
    hidden, pre_norm = _main(*nnx.split(model), jnp.asarray(ids))
    return ids, np.asarray(hidden), np.asarray(pre_norm)


@functools.partial(jax.jit, static_argnums=0)
def _mtp_logits(graphdef, state, ids, hidden):
    return nnx.merge(graphdef, state).mtp_logits(ids, hidden)


@functools.partial(jax.jit, static_argnums=0)
def _mtp_step(graphdef, state, next_ids, hidden, cache, mask, positions):
    return nnx.merge(graphdef, state).mtp_forward(next_ids, hidden, cache, attention_mask=mask, position_ids=positions)


def _check_against_vllm(ckpt, main, dtype: str, bound: float) -> dict[str, float]:
    """qjax's head (``mtp_logits``; the cached ``mtp_forward`` in two chunks and one chained draft step) vs the
    oracle on vLLM's inputs; returns the measured relative errors. Both sides get the float32 main model's hidden
    (``main``; in ``dtype``): what is compared is the head."""
    folder, weights, config = ckpt
    model = qjax.load_model(folder, dtype=dtype)
    graphdef, state = nnx.split(model)
    ids, hidden, _ = main
    hidden = hidden.astype(model.dtype)
    # vLLM's first pass over the prompt: row t = (h_t, token t+1) at target position t, predicting token t+2
    next_ids, h_in, positions = vllm_mtp.first_pass_inputs(ids, hidden)
    want, want_y = vllm_mtp.mtp_forward(weights, config, next_ids, h_in, positions)
    errors = {"mtp_logits": _rel(_mtp_logits(graphdef, state, jnp.asarray(ids), jnp.asarray(hidden)), want)}

    # the cached path in two equal chunks, then a chained draft step padded to the same width (one program)
    half = (T - 1) // 2
    cache = model.init_mtp_cache(B, T + 1)
    ones = np.ones((B, half), bool)
    parts, ys = [], []
    for lo in (0, half):
        logits, y, cache = _mtp_step(graphdef, state, jnp.asarray(next_ids[:, lo:lo + half]),
                                     jnp.asarray(h_in[:, lo:lo + half]), cache, jnp.asarray(ones),
                                     jnp.asarray(positions[:, lo:lo + half], jnp.int32))
        parts.append(np.asarray(logits))
        ys.append(np.asarray(y))
    errors["mtp_forward"] = _rel(np.concatenate(parts, axis=1), want)
    errors["mtp_forward hidden"] = _rel(np.concatenate(ys, axis=1), want_y)
    # the chained step (vLLM's spec_step_idx 1): the head's own output at the last row and its argmax draft, one
    # position on; the oracle reruns the whole causal sequence with that row appended
    draft = np.argmax(parts[-1][:, -1], axis=-1).astype(np.int32)[:, None]
    y_last = ys[-1][:, -1:]
    pad = lambda a: np.concatenate([a, np.zeros_like(a[:, :1]).repeat(half - 1, axis=1)], axis=1)
    logits, _, _ = _mtp_step(graphdef, state, jnp.asarray(pad(draft)), jnp.asarray(pad(y_last)), cache,
                             jnp.asarray(np.arange(half)[None].repeat(B, 0) < 1),
                             jnp.asarray(pad(positions[:, -1:] + 1), jnp.int32))
    chained, _ = vllm_mtp.mtp_forward(weights, config, np.concatenate([next_ids, draft], 1),
                                      np.concatenate([h_in, y_last.astype(np.float64)], 1),
                                      np.concatenate([positions, positions[:, -1:] + 1], 1))
    errors["chained step"] = _rel(np.asarray(logits)[:, 0], chained[:, -1])
    print(f"{dtype} relative errors: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    for what, err in errors.items():
        assert err <= bound, f"{what}: {err:.3e} of the logits' scale > {bound:.0e}"
    return errors


def test_float32_head_matches_vllm(ckpt, main):
    _check_against_vllm(ckpt, main, "float32", F32_REL)


@pytest.mark.slow  # 7.4–8.5 s (its two float64 compiles) on the shared 2-core machine
def test_float64_head_matches_vllm(ckpt, main, x64):
    _check_against_vllm(ckpt, main, "float64", F64_REL)


def test_oracle_tells_the_conventions_apart(ckpt, main):
    """Each convention the comparison pins moves the oracle's logits by ≥ WRONG of their scale (so the tests above
    would fail on it), except RoPE's absolute offset: vLLM runs row t at position t, qjax's ``mtp_logits`` at t+1 —
    the same logits (attention sees position differences only)."""
    _, weights, config = ckpt
    text = config["text_config"]
    ids, hidden, pre_norm = main
    hidden, pre_norm = hidden.astype(np.float64), pre_norm.astype(np.float64)
    # qjax's `.hidden` is the post-final-norm hidden, as vLLM's Qwen3NextModel.forward returns it
    post = vllm_mtp.rms_norm(pre_norm, weights["model.language_model.norm.weight"], text["rms_norm_eps"])
    assert _rel(hidden, post) <= F32_REL
    args = vllm_mtp.first_pass_inputs(ids, hidden)
    base, _ = vllm_mtp.mtp_forward(weights, config, *args)
    one_row, _ = vllm_mtp.mtp_forward(weights, config, *(a[1] for a in args))  # vLLM's flat [T] form
    assert _rel(one_row, base[1]) <= F64_REL
    shifted, _ = vllm_mtp.mtp_forward(weights, config, args[0], args[1], args[2] + 1)
    assert _rel(shifted, base) <= F64_REL

    h = text["hidden_size"]
    layer = "mtp.layers.0."
    fc = weights["mtp.fc.weight"]
    mutants = {
        "fc sees [hidden; embedding]": {"mtp.fc.weight": np.concatenate([fc[:, h:], fc[:, :h]], axis=1)},
        "no shared expert": {f"{layer}mlp.shared_expert.down_proj.weight":
                             np.zeros_like(weights[f"{layer}mlp.shared_expert.down_proj.weight"])},
        "plain-w RMSNorms": {k: v - 1.0 for k, v in weights.items() if k.startswith("mtp.") and "norm" in k},
    }
    if f"{layer}mlp.experts.gate_up_proj" in weights:
        gu = weights[f"{layer}mlp.experts.gate_up_proj"]
        mutants["gate_up_proj as [up; gate]"] = {f"{layer}mlp.experts.gate_up_proj": np.concatenate(
            np.split(gu, 2, axis=1)[::-1], axis=1)}
    else:
        mutants["gate and up swapped"] = {
            f"{layer}mlp.experts.{e}.{a}_proj.weight": weights[f"{layer}mlp.experts.{e}.{b}_proj.weight"]
            for e in range(text["num_experts"]) for a, b in (("gate", "up"), ("up", "gate"))}
    moved = {name: _rel(vllm_mtp.mtp_forward({**weights, **change}, config, *args)[0], base)
             for name, change in mutants.items()}
    moved["pre-final-norm hidden"] = _rel(vllm_mtp.mtp_forward(
        weights, config, args[0], vllm_mtp.first_pass_inputs(ids, pre_norm)[1], args[2])[0], base)
    print("moved: " + ", ".join(f"{k} {v:.2e}" for k, v in moved.items()))
    assert min(moved.values()) >= WRONG, moved
