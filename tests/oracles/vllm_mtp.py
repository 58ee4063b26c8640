"""vLLM's Qwen3.5-MoE MTP head as a float64 numpy oracle for qjax's ``mtp_logits`` / ``mtp_forward``.

A transcription, in numpy and in our own words, of what vLLM computes for ``--speculative-config '{"method": "mtp"}'``
on a ``qwen3_5_moe`` checkpoint (vllm-project/vllm, read at commits 01d99805d1ef for ``qwen3_5_mtp.py``,
00def4f84211 for ``qwen3_5.py``, 002d6073aa03 for ``qwen3_next.py``):

- ``vllm/model_executor/models/qwen3_5_mtp.py``
  - ``Qwen3_5MoeMTP`` (= ``Qwen3_5MTP`` + MoE bookkeeping): ``forward`` runs the predictor, ``compute_logits`` applies
    the *main model's* ``lm_head`` (``ParallelLMHead``, or ``embed_tokens`` when ``tie_word_embeddings``);
    ``load_weights.remap_weight_names`` maps ``mtp.*`` → ``model.*``, keeps ``lm_head`` and ``embed_tokens``
    (dropping ``language_model.`` from the latter) and ignores everything else.
  - ``Qwen3_5MultiTokenPredictor.forward``: ``e = pre_fc_norm_embedding(embed_tokens[input_ids])``,
    ``h = pre_fc_norm_hidden(hidden_states)``, ``fc(cat([e, h], -1))`` — embedding first —, then decoder layer
    ``spec_step_idx % mtp_num_hidden_layers`` (a ``Qwen3_5DecoderLayer`` of type ``full_attention``) and
    ``norm(hidden, residual)``, i.e. the zero-centred RMSNorm of the layer's output plus its residual.
  - ``Qwen3_5MultiTokenPredictor.load_weights``: fused experts ``experts.gate_up_proj [E, 2I, H]`` are split with
    ``chunk(2, dim=-2)`` into w1 (gate, first I rows) and w3 (up, last I rows) per expert, without a transpose
    ("qwen3.5 no need to transpose"); ``experts.down_proj [E, H, I]`` is w2 per expert; per-expert checkpoints give
    ``experts.{e}.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]) directly.
- ``vllm/model_executor/models/qwen3_5.py``: ``Qwen3_5RMSNorm`` is ``GemmaRMSNorm`` (``x·rsqrt(mean(x²)+eps)·(1+w)``
  in float32, with the fused residual add ``norm(x, residual)`` normalising ``x + residual``); ``Qwen3_5DecoderLayer``
  builds ``Qwen3NextAttention`` and, for ``qwen3_5_moe_text``, ``Qwen3NextSparseMoeBlock``.
- ``vllm/model_executor/models/qwen3_next.py``
  - ``Qwen3NextDecoderLayer.forward`` (pre-norm residual): ``r = x; a = input_layernorm(x); a = attn(a)``;
    ``a, r = post_attention_layernorm(a, r)`` (``r ← a + r``, ``a ← norm(r)``); returns ``(mlp(a), r)``.
  - ``Qwen3NextAttention._project_qkv_gate`` / ``forward``: ``q_proj``'s output viewed ``[.., heads, 2·head_dim]``
    and chunked into query and gate *per head*; per-head ``q_norm``/``k_norm`` (GemmaRMSNorm) before RoPE;
    ``get_rope`` with ``rotary_dim = int(head_dim · partial_rotary_factor)``, NeoX style, ``MRotaryEmbedding``
    (``mrope_interleaved``) — for text the three position rows are equal and it is plain RoPE; attention scaled by
    ``head_dim^-0.5``, causal (``AttentionType.DECODER``), GQA; output ``· sigmoid(gate)`` then ``o_proj``.
  - ``Qwen3NextSparseMoeBlock``: ``FusedMoE`` with softmax routing over ``gate`` logits, top ``num_experts_per_tok``,
    ``renormalize = getattr(config, "norm_topk_prob", True)``, SiLU-gated experts; the shared expert is
    ``Qwen2MoeMLP(expert_gate=shared_expert_gate)`` = ``sigmoid(shared_expert_gate(x)) · down(silu(gate(x))·up(x))``.
- ``vllm/model_executor/layers/rotary_embedding/mrope.py`` (``apply_interleaved_rope``): frequency j reads the H row
  when ``j % 3 == 1 and j < 3·section[1]``, the W row when ``j % 3 == 2 and j < 3·section[2]``, else the T row.

What vLLM feeds the head (``vllm/v1/spec_decode/eagle.py``, ``set_inputs_first_pass``): the target model's returned
hidden states — ``Qwen3NextModel.forward`` ends with ``self.norm(hidden_states, residual)``, so the *post-final-norm*
hidden —, the input ids shifted left by one (row t gets token t+1; the last row the newly sampled token) and the
*target* positions unchanged (row t runs at position t, the position of ``h_t``, not of token t+1). RoPE makes
attention depend on position differences only, so running every row one position later (as qjax does) gives the same
logits up to rounding; :func:`first_pass_inputs` builds vLLM's inputs from a prompt.

Numpy, float64 throughout (where vLLM computes in float32 — the norms, the router softmax — this computes in float64);
no torch, no vLLM.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

MTP = "mtp."


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text config of a composite ``qwen3_5_moe`` config.json dict (or the dict itself when already text)."""
    return dict(config.get("text_config", config))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """vLLM ``GemmaRMSNorm`` (= ``Qwen3_5RMSNorm``): zero-centred weight, ``x / rms(x) · (1 + w)`` over the last
    axis."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _w(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in weights:
        raise KeyError(f"{name} not in the weights (got {len(weights)} tensors; a quantized checkpoint is not "
                       "supported by this oracle)")
    return np.asarray(weights[name], np.float64)


def embedding(weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """``[V, H]`` ``embed_tokens`` as vLLM's MTP loader finds it (``language_model.`` dropped: the composite and the
    text-only names both land on the head's ``embed_tokens``)."""
    for name in ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"):
        if name in weights:
            return _w(weights, name)
    raise KeyError("no embed_tokens weight (model.language_model.embed_tokens.weight or model.embed_tokens.weight)")


def lm_head(weights: Mapping[str, np.ndarray], cfg: Mapping[str, Any]) -> np.ndarray:
    """``[V, H]``: the main model's ``lm_head`` (``Qwen3_5MTP.__init__``: the embedding when tied)."""
    return embedding(weights) if cfg.get("tie_word_embeddings", False) else _w(weights, "lm_head.weight")


def routed_experts(weights: Mapping[str, np.ndarray], prefix: str, num_experts: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate ``[E, I, H]``, up ``[E, I, H]``, down ``[E, H, I]``) of the routed experts at ``prefix``
    (``"mtp.layers.0.mlp.experts."``), from either on-disk layout, as vLLM's loader splits them into w1/w3/w2.

    Fused: ``gate_up_proj [E, 2I, H]`` (no ``.weight``) halved along its rows, gate first; ``down_proj [E, H, I]``.
    Per expert: ``{e}.gate_proj.weight [I, H]``, ``{e}.up_proj.weight [I, H]``, ``{e}.down_proj.weight [H, I]``.
    """
    if prefix + "gate_up_proj" in weights:
        gate_up = _w(weights, prefix + "gate_up_proj")
        down = _w(weights, prefix + "down_proj")
        if gate_up.shape[0] != num_experts or gate_up.shape[1] % 2:
            raise ValueError(f"{prefix}gate_up_proj: shape {gate_up.shape}, expected [{num_experts}, 2I, H]")
        gate, up = np.split(gate_up, 2, axis=1)  # vLLM: loaded_weight.chunk(2, dim=-2) → w1 (gate), w3 (up)
        return gate, up, down
    stack = lambda proj: np.stack([_w(weights, f"{prefix}{e}.{proj}.weight") for e in range(num_experts)])
    return stack("gate_proj"), stack("up_proj"), stack("down_proj")


def rope_tables(positions: np.ndarray, cfg: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[B, T, rotary_dim]`` for ``positions [3, B, T]`` (T, H, W rows; equal for text): vLLM
    ``MRotaryEmbedding`` with ``mrope_interleaved`` (``get_rope``:
    ``rotary_dim = int(head_dim · partial_rotary_factor)``, ``inv_freq[j] = θ^(-2j/rotary_dim)``), each frequency
    doubled for NeoX rotate-half."""
    rp = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if rp.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rp.get('rope_type')!r}: only 'default' is transcribed")
    rotary_dim = int(head_dim * rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = positions.astype(np.float64)[..., None] * inv_freq  # [3, B, T, half]
    row = np.zeros(half, np.int64)
    section = rp.get("mrope_section")
    if section is not None:
        j = np.arange(half)
        if rp.get("mrope_interleaved", False):
            row[(j % 3 == 1) & (j < 3 * section[1])] = 1
            row[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:  # chunked sections (Qwen2-VL style): T for the first section[0] frequencies, then H, then W
            row[section[0]:section[0] + section[1]] = 1
            row[section[0] + section[1]:] = 2
    sel = np.where(row == 1, freqs[1], np.where(row == 2, freqs[2], freqs[0]))  # [B, T, half]
    emb = np.concatenate([sel, sel], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotate-half on the first ``rotary_dim`` channels of each head; ``x [B, T, heads, D]``, cos/sin
    ``[B, T, rotary_dim]``; the other channels pass through."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rotated = np.concatenate([-x2, x1], axis=-1)
    xr = xr * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return np.concatenate([xr, xp], axis=-1)


def gated_attention(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, cfg: Mapping[str, Any],
                    cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``Qwen3NextAttention.forward`` on ``x [B, T, H]`` → ``[B, T, H]``: causal over the T positions (no cache)."""
    b, t, _ = x.shape
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    eps = cfg["rms_norm_eps"]
    q_gate = (x @ _w(weights, prefix + "q_proj.weight").T).reshape(b, t, nq, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:]  # per head: [query | gate] (torch.chunk(q_gate, 2, dim=-1))
    gate = gate.reshape(b, t, nq * d)
    k = (x @ _w(weights, prefix + "k_proj.weight").T).reshape(b, t, nkv, d)
    v = (x @ _w(weights, prefix + "v_proj.weight").T).reshape(b, t, nkv, d)
    q = apply_rope(rms_norm(q, _w(weights, prefix + "q_norm.weight"), eps), cos, sin)
    k = apply_rope(rms_norm(k, _w(weights, prefix + "k_norm.weight"), eps), cos, sin)
    group = nq // nkv
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # q head h reads kv head h // group
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, nq * d)
    return (o * sigmoid(gate)) @ _w(weights, prefix + "o_proj.weight").T


def sparse_moe(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, cfg: Mapping[str, Any]) -> np.ndarray:
    """``Qwen3NextSparseMoeBlock.forward`` on ``x [..., H]``: softmax router, top-k (renormalised unless
    ``norm_topk_prob`` is false), SiLU-gated routed experts, plus the sigmoid-gated shared expert."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    n_exp, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    logits = x @ _w(weights, prefix + "gate.weight").T  # [N, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [N, k]
    top_w = np.take_along_axis(probs, top, axis=-1)
    if cfg.get("norm_topk_prob", True):
        top_w = top_w / top_w.sum(-1, keepdims=True)
    gate, up, down = routed_experts(weights, prefix + "experts.", n_exp)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for e, w in zip(top[n], top_w[n]):
            out[n] += w * (down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])))
    s = prefix + "shared_expert."
    shared = (silu(x @ _w(weights, s + "gate_proj.weight").T) * (x @ _w(weights, s + "up_proj.weight").T)
              ) @ _w(weights, s + "down_proj.weight").T
    out += sigmoid(x @ _w(weights, prefix + "shared_expert_gate.weight").T) * shared
    return out.reshape(shape)


def mtp_forward(weights: Mapping[str, np.ndarray], config: Mapping[str, Any], input_ids: np.ndarray,
                hidden_states: np.ndarray, positions: np.ndarray, *, spec_step_idx: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """``Qwen3_5MoeMTP.forward`` + ``compute_logits`` for one request per batch row.

    Args:
      weights: checkpoint tensors by their on-disk names (``mtp.*``, the embedding, ``lm_head.weight``); numpy.
      config: the checkpoint's config.json dict (composite or text).
      input_ids: ``[B, T]`` or ``[T]`` int — the token *after* each hidden's position (vLLM's shifted ids).
      hidden_states: ``[B, T, H]`` or ``[T, H]`` — the main model's post-final-norm hidden (or, chained, the head's
        previous output).
      positions: ``input_ids.shape`` text positions, or ``(3, *input_ids.shape)`` M-RoPE rows.
      spec_step_idx: which MTP layer (``spec_step_idx % mtp_num_hidden_layers``).
    Returns:
      (logits ``[B, T, V]``, the head's output hidden ``[B, T, H]`` after ``mtp.norm``), float64; unbatched inputs
      give unbatched outputs.
    """
    cfg = text_config(config)
    ids = np.asarray(input_ids)
    single = ids.ndim == 1
    hidden = np.asarray(hidden_states, np.float64)
    pos = np.asarray(positions)
    if single:
        ids, hidden = ids[None], hidden[None]
        pos = pos[None] if pos.ndim == 1 else pos[:, None]
    if pos.shape == ids.shape:
        pos = np.broadcast_to(pos[None], (3, *ids.shape))
    if pos.shape != (3, *ids.shape) or hidden.shape[:2] != ids.shape:
        raise ValueError(f"shapes: input_ids {ids.shape}, hidden_states {hidden.shape}, positions {pos.shape}")
    eps = cfg["rms_norm_eps"]
    layer = f"{MTP}layers.{spec_step_idx % max(1, cfg.get('mtp_num_hidden_layers', 1))}."

    e = rms_norm(embedding(weights)[ids], _w(weights, MTP + "pre_fc_norm_embedding.weight"), eps)
    h = rms_norm(hidden, _w(weights, MTP + "pre_fc_norm_hidden.weight"), eps)
    x = np.concatenate([e, h], axis=-1) @ _w(weights, MTP + "fc.weight").T  # [embedding; hidden] → H

    cos, sin = rope_tables(pos, cfg)
    residual = x
    a = gated_attention(rms_norm(x, _w(weights, layer + "input_layernorm.weight"), eps), weights,
                        layer + "self_attn.", cfg, cos, sin)
    residual = a + residual
    m = sparse_moe(rms_norm(residual, _w(weights, layer + "post_attention_layernorm.weight"), eps), weights,
                   layer + "mlp.", cfg)
    y = rms_norm(m + residual, _w(weights, MTP + "norm.weight"), eps)  # norm(hidden, residual)
    logits = y @ lm_head(weights, cfg).T
    return (logits[0], y[0]) if single else (logits, y)


def first_pass_inputs(prompt_ids: np.ndarray, hidden_states: np.ndarray, next_token_ids: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's first MTP pass over a prompt (``EagleProposer.set_inputs_first_pass``, default path): ids shifted left
    by one with the sampled ``next_token_ids [B]`` last (without them, the last row is dropped: T-1 rows, each with
    a known next token), hidden unchanged, positions = the target positions ``0 … T-1``.

    ``prompt_ids [B, T]``, ``hidden_states [B, T, H]`` → (input_ids, hidden_states, positions), each ``[B, T']``
    (``[B, T', H]``)."""
    ids = np.asarray(prompt_ids)
    b, t = ids.shape
    if next_token_ids is None:
        return ids[:, 1:], np.asarray(hidden_states)[:, :-1], np.broadcast_to(np.arange(t - 1), (b, t - 1))
    shifted = np.concatenate([ids[:, 1:], np.asarray(next_token_ids).reshape(b, 1)], axis=1)
    return shifted, np.asarray(hidden_states), np.broadcast_to(np.arange(t), (b, t))
